"""Names shared by the trainer side and the agent: the job tag and what a job name or tenant URL may be.

Kept apart from :mod:`timeslice_verl.config.schema` so the agent, which validates every request, needs no
Hydra or OmegaConf to know them.
"""

from __future__ import annotations

import enum
import re
import urllib.parse
from typing import Sequence

class SwapMode(str, enum.Enum):
    """How a released job's memory leaves the GPU (``timeslice.handoff.swap``, the agent's ``release``, its state
    file): one type from the config to the wire. A ``str``: it compares, formats and serialises as its value."""

    checkpoint = "checkpoint"
    """The driver checkpoints the processes' memory to host RAM."""
    park = "park"
    """The ranks park their own tensors; the agent only locks the processes."""
    park_checkpoint = "park+checkpoint"
    """The ranks park, the driver checkpoints the remainder (the GPU left empty)."""
    resident = "resident"
    """Nothing moves: the tensors stay, beside the awake tenant."""

    def __str__(self) -> str:
        return self.value

    @property
    def parks(self) -> bool:
        """The ranks park their tensors (and unpark them after the thaw)."""
        return self in (SwapMode.park, SwapMode.park_checkpoint)

    @property
    def locks_only(self) -> bool:
        """The agent locks the processes without checkpointing them."""
        return self in (SwapMode.park, SwapMode.resident)


SWAP_MODES = tuple(m.value for m in SwapMode)
"""The values of :class:`SwapMode` (what a request's ``swap`` may be)."""
SWAP_AUTO = "auto"
"""The setting ``timeslice.handoff.swap=auto``: the trainer picks a :class:`SwapMode` per run (held as None)."""


VALIDATION_VERSION = "timeslice_validation_version"
"""The metadata key of a validation run's batch: the version it validates (the runner writes it, status reads it)."""
POLICY_SNAPSHOT, POLICY_RELEASE = "timeslice_policy_snapshot", "timeslice_policy_release"
"""verl worker-group methods (``ONE_TO_ALL``): every rank gathers a due version's tensors and rank 0 keeps them for
the policy tenant; then every rank drops what it kept (:mod:`timeslice_verl.ranks.policy`)."""


class TenantRole(str, enum.Enum):
    """What a tenant serves, and so which batches its lines come from (the batch service's ``tenant_role`` of a
    batch, the feeder's of its tenant): one type from the config to the store."""

    batch = "batch"
    """Users' batches (``timeslice.tenant.urls``, ``timeslice.batch.tenant_urls``)."""
    policy = "policy"
    """Validation runs of the trainer's policy (``timeslice.validate.policy_url``): only its lines, only there."""

    def __str__(self) -> str:
        return self.value


def swap_setting(value: object) -> SwapMode | None:
    """A swap setting as its type: a :class:`SwapMode`, or None for ``auto``; anything else a ValueError naming the
    choices."""
    if value is None or value == SWAP_AUTO:
        return None
    try:
        return SwapMode(value)
    except ValueError:
        raise ValueError(f"{value!r} is not one of {', '.join((*SWAP_MODES, SWAP_AUTO))}") from None


class YieldBy(str, enum.Enum):
    """How the tenant gives the GPU back (``timeslice.tenant.yield_by``; :mod:`timeslice_verl.agent.tenant.hold`)."""

    auto = "auto"
    """A pause alone when the trainer's measured peak and the tenant's awake memory fit the GPU with a margin."""
    sleep = "sleep"
    """Always pause, then sleep (the tenant's memory freed at every yield)."""

    def __str__(self) -> str:
        return self.value


JOB_TAG_ENV = "TIMESLICE_JOB"
"""Environment variable that tags a job's GPU worker processes (its value is the job name)."""
SCOPE_ENV = "TIMESLICE_SCOPE"
"""Optional: an agent takes only the tagged processes of its own scope (the same value in both environments, or unset
in both), so independent deployments on one host — two copies of the test suite, say — never take each other's
workers for a job of the same name."""
JOB_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
URL_RE = re.compile(r"https?://[^/\s]+(/\S*)?")


def valid_job(name: object) -> bool:
    """Letters, digits, '.', '_', '-', at most 64, starting with a letter or digit (whole string)."""
    return isinstance(name, str) and JOB_RE.fullmatch(name) is not None


def clean_urls(urls: Sequence[str]) -> list[str]:
    """A tenant's addresses as the agent keeps them: a list, each without its trailing ``/``. A string is refused (it
    would be taken apart letter by letter): several servers are a list, never a joined string."""
    if isinstance(urls, str):
        raise TypeError(f"tenant addresses are a list of URLs, got the string {urls!r:.80}")
    return [u.strip().rstrip("/") for u in urls]


LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0"}


def server_key(url: str) -> str:
    """What tells two tenant servers apart: scheme, host (every loopback name is one host, case does not
    count) and port (the scheme's default when none is written). ``http://localhost:8000/`` and
    ``http://127.0.0.1:8000`` are one server. A URL the parser refuses is its own key."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return url.strip()
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if host in LOOPBACK_HOSTS or host.startswith("127."):
        host = "loopback"
    port = port or (443 if scheme == "https" else 80)
    return f"{scheme}://{host}:{port}/{parts.path.strip('/')}"


def repeated_url(urls: Sequence[str]) -> str | None:
    """The first address a tenant lists twice (a server can yield its GPU only once), or None. Two spellings of one
    server (``localhost`` and ``127.0.0.1``, a default port written out) count as twice."""
    seen: set[str] = set()
    for u in urls:
        if server_key(u) in seen:
            return u
        seen.add(server_key(u))
    return None


def valid_url(url: object) -> bool:
    """One http(s) URL with a host (no whitespace, no comma: several servers are a list, never a joined string)."""
    return isinstance(url, str) and "," not in url and URL_RE.fullmatch(url) is not None


def valid_urls(urls: object) -> bool:
    """A tenant's addresses: a non-empty list of URLs (:func:`valid_url`), none listed twice."""
    return (isinstance(urls, (list, tuple)) and bool(urls) and all(valid_url(u) for u in urls)
            and repeated_url(urls) is None)
