"""The ``timeslice`` config section: a structured-config schema and its validation.

One schema serves every process: the trainer (the section arrives inside verl's config object),
the agent daemon and the CLI (composed from the same Hydra group in ``conf/``), so a dotted
override means the same thing everywhere. Unknown keys, wrong types and values outside a key's
choices fail with :class:`ConfigError`, whose message starts with the full key.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from timeslice_verl.log import get_logger
from timeslice_verl.config.paths import default_runtime_dir, default_socket, socket_path, state_path  # noqa: F401,E402
from timeslice_verl.config.checks import SECTION, ConfigError, _full_key, setting_at, check_urls as _check_urls, check_validate as _check_validate, no_dsn_in_store as _no_dsn_in_store  # noqa: F401 (re-exported)
from timeslice_verl.config.pg_bounds import RANGES as PG_RANGES, PostgresBounds, check_bounds
from timeslice_verl.names import JOB_TAG_ENV, SWAP_AUTO, SWAP_MODES, YieldBy, clean_urls, repeated_url, valid_job, valid_url  # noqa: F401 (re-exported)

log = get_logger("config")
NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0", "NCCL_P2P_DISABLE": "1"}
"""What NCCL in trainer workers needs to survive CUDA checkpoint/restore."""


class Choice(str, enum.Enum):
    """A string setting with fixed choices: Hydra rejects any other value at composition, naming the
    key, and the value still compares and formats as its plain string."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


# functional form: member names equal their values, hyphens included (OmegaConf converts by name)
Adapter = Choice("Adapter", [(v, v) for v in ("auto", "stock", "v1", "hooked", "fork")])
"""How events are fired from verl (``timeslice.adapter``)."""
Backend = Choice("Backend", [(v, v) for v in ("cuda", "cuda-cli", "sigstop")])
"""How the agent freezes a job's processes (``timeslice.agent.backend``)."""
PauseMode = Choice("PauseMode", [(v, v) for v in ("wait", "keep")])
"""How vLLM hands the GPU over (``timeslice.tenant.pause_mode``)."""


StoreKind = Choice("StoreKind", [(v, v) for v in ("sqlite", "postgresql")])
"""Where the batch queue is kept (``timeslice.batch.store``)."""
Swap = Choice("Swap", [(v, v) for v in (*SWAP_MODES, SWAP_AUTO)])
"""How the trainer's GPU memory leaves the GPU (``timeslice.handoff.swap``)."""


@dataclass
class AgentSettings:
    """The node's snapshot agent: where it listens and how it freezes trainer processes."""

    socket: str = ""
    """Unix socket path; empty: ``$XDG_RUNTIME_DIR/timeslice-verl/agent.sock`` or
    ``/tmp/timeslice-verl-<uid>/agent.sock``."""
    state_file: str = ""
    """Where the agent persists its state machine; empty: beside the socket."""
    lock_dir: str = "/tmp"
    """Where each agent takes a lock per GPU it arbitrates (``timeslice-verl-gpu-<id>.lock``): one agent per
    GPU on the machine, whatever its socket or state file. Every agent of a node must use the same directory."""
    backend: Backend = Backend["cuda"]
    """Freeze backend: ``cuda`` (driver API), ``cuda-cli`` (the cuda-checkpoint binary) or
    ``sigstop`` (CPU test backend: pauses processes, frees no GPU memory)."""
    gpus: List[int] = field(default_factory=lambda: [0])
    """GPU indices (NVML) this agent arbitrates; ``[]``: every GPU of the node, resolved when the agent starts (a
    node's DaemonSet then writes no index down)."""
    driver_timeout_s: float = 300.0
    """Timeout of each CUDA driver call (lock, checkpoint, restore, unlock) per process."""
    connect_timeout_s: float = 30.0
    """How long a client retries reaching the agent (covers an agent restart)."""
    autostart: bool = False
    """Let the agent plugin start ``timeslice-verl agent`` when none answers on the socket."""
    across_nodes: bool = False
    """verl trainers whose workers span nodes: every node's agent (on that node's default socket, each started
    with its own tenant) takes part in each handoff, through one Ray actor per node. Model loading goes to every
    live Ray node whose agent answers; once the workers exist, to the nodes that host them."""
    reattach_grace_s: float = 60.0
    """After an agent restart, how long a job that held the GPU keeps it without its client coming back (a client
    reattaches by itself the moment the agent answers again; this covers one that is gone for good)."""
    shutdown_timeout_s: float = 10.0
    """On SIGTERM, how long the agent waits for each step of its shutdown (a transition under way, the tenant's
    wake-up, its connections) before it goes on."""
    freeze_off_gpu: bool = False
    """Also freeze tagged or registered processes NVML does not place on ``gpus``. The rollouter and its vLLM
    are never frozen, on ``gpus`` or not, once the trainer registered its ranks."""
    park_overhead_gib: float = 3.0
    """After a worker parked (``handoff.swap=park``), how much GPU memory it may still show beyond what it
    reported keeping (CUDA context, NCCL, cuBLAS workspaces) before the agent refuses to lend the GPU."""
    metrics_port: int = 0
    """Prometheus endpoint port on ``metrics_host``; 0 turns it off."""
    metrics_host: str = "127.0.0.1"
    cuda_checkpoint_bin: str = "cuda-checkpoint"
    """The binary the ``cuda-cli`` backend runs."""


@dataclass
class TenantSettings:
    """The co-resident vLLM server that harvests the trainer's idle GPU time."""

    url: str = ""
    """One server's base URL, e.g. ``http://127.0.0.1:8000``: the shorthand for ``urls=[url]``; empty with ``urls``
    empty: no tenant (the GPU just idles)."""
    urls: List[str] = field(default_factory=list)
    """The tenant's addresses, the one name every part reads: one vLLM per GPU of the trainer, yielding and waking
    together, e.g. ``'timeslice.tenant.urls=["http://127.0.0.1:8001","http://127.0.0.1:8002"]'``."""
    sleep_level: int = 1
    """vLLM sleep level: 1 keeps weights in host RAM (fast wake), 2 drops them."""
    pause_mode: PauseMode = PauseMode["keep"]
    """How vLLM ≥ 0.17 hands over: ``keep`` freezes in-flight requests at once and resumes them after the
    wake-up (no work lost, and the trainer waits for no generation: the default); ``wait`` lets them finish
    first (the trainer waits for them). A vLLM that refuses ``keep`` is paused with ``wait``, with a warning."""
    yield_by: YieldBy = YieldBy.auto
    """``auto``: a pause alone (no sleep, held requests keep their KV cache) where NVML's measured trainer peak and the
    awake tenant fit with the margin; else, and with ``sleep``, pause and sleep (:mod:`timeslice_verl.agent.tenant.hold`)."""
    awake_margin_gib: float = 4.0
    """The room kept beside the trainer's peak and a tenant held awake (at least a quarter of the peak)."""
    request_timeout_s: float = 30.0
    """Timeout of each control request (pause, sleep, wake_up, resume)."""
    drain_timeout_s: float = 600.0
    """How long a pause may wait for in-flight requests to finish (``reclaim_deadline_s`` bounds it too)."""
    reclaim_deadline_s: float = 10.0
    """The longest the tenant may take to give the GPU back. Past it the agent goes down the ladder: abort
    the tenant's in-flight requests, then kill its processes (only those tagged ``TIMESLICE_TENANT``); the
    trainer gets its GPU within this bound whatever the tenant does. 0: no bound (wait for the tenant)."""
    pause_grant_s: float = 0.05
    """A yield that only pauses the tenant (``yield_by=auto``, the trainer's peak fits beside it) moves no memory: the
    trainer gets the GPU once vLLM answers the pause or after this long, whichever comes first, the pause landing
    behind the grant (a busy API server answers it up to ~0.2 s late though its engine stops within a step). At
    worst the trainer's first kernels share the GPU with vLLM's last step. Raise it to wait for the answer."""
    probe_interval_s: float = 0.5
    """While the tenant has the GPU, how often the agent checks that it still answers and is in the state recorded
    (a tenant that stops answering is marked wedged: reclaiming it goes straight to the kill). 0: never."""
    probe_timeout_s: float = 0.75
    """How long one such check may take before it counts as no answer (two in a row: wedged, at most
    2 × (interval + timeout) = 2.5 s after it stopped; a reclaim still asks it once more before the kill)."""
    warm_up: bool = True
    """Put a newly registered tenant to sleep and wake it twice while no trainer needs the GPU: a vLLM's first sleep
    pays one-off costs (pinning its host buffers, many times a later sleep) that would otherwise fall on the trainer's
    first acquire and keep the first valleys from being lent; the tenant's footprint is known before the first release
    too. Its sleeps wait as long as they take while no trainer asks (a large model's first can take many seconds),
    then ``reclaim_deadline_s`` from the ask."""


@dataclass
class HandoffSettings:
    """How the trainer side asks for the GPU."""

    acquire_timeout_s: float = 0.0
    """Give up an acquire after this long (0: wait as long as it takes)."""
    prepare: bool = True
    """Bring the GPUs back before the batch is complete: with a park swap the acquire and every rank's unpark
    run in the background, so the trainer's acquire waits for nothing; with a checkpoint swap the agent starts
    restoring early."""
    prepare_lead_s: float = 0.0
    """How early to start the way back; 0: 1.2 × the last way back measured in this run (yield, thaw, unpark)."""
    break_even_margin: float = 1.5
    """Lend a valley only when it is expected to last this many round trips (park, freeze, the tenant's wake and
    yield, thaw, unpark, as measured in this run); a release whose next batch is already queued is always
    skipped. 0: lend every valley."""
    swap: Swap = Swap["auto"]
    """How the trainer's GPU memory leaves the GPU: ``auto`` (``resident`` where the trainer's tensors and the awake
    tenant fit side by side, else ``park`` where every node has the host RAM it pins, else ``checkpoint``; the log
    and ``doctor`` say which and why), ``resident`` (nothing moves: the ranks free their caches, the agent locks them
    and wakes the tenant beside them; the way back is the tenant's yield), ``checkpoint`` (the agent's driver
    checkpoint moves the whole process, ~2 GB/s), ``park`` (each worker copies its tensors to pinned host RAM at
    copy-engine speed, ~50 GB/s, and the agent only locks it; context and NCCL stay, ~1–2 GB) or
    ``park+checkpoint`` (park, then the driver checkpoint moves the remainder: the GPU is left empty). Park modes
    pin host RAM once per worker, the size of its parameters, gradients and optimizer state."""
    late_cost: float = 4.0
    """What a second of the trainer waiting for its GPU costs against a second of GPU time lost to the tenant: the
    way back is timed so the batch is ready before it with probability 1 / (1 + late_cost), calibrated by the
    run's own forecast errors."""


@dataclass
class PluginSettings:
    """Which hook plugins the trainer process loads."""

    disabled: List[str] = field(default_factory=list)
    """Names never loaded: bundled (``agent``, ``timeline``, ``metrics``) or entry-point names."""
    enabled: Optional[List[str]] = None
    """Entry-point plugins to load (group ``timeslice_verl``); null: all installed."""
    modules: List[str] = field(default_factory=list)
    """Extra plugins by import path, ``package.module`` or ``package.module:attr``."""
    trace: bool = False
    """Log every hook call (plugin, hook, duration) to the ``timeslice.trace`` logger."""
    options: Dict[str, Any] = field(default_factory=dict)
    """Free-form settings for third-party plugins, one mapping per plugin name."""


@dataclass
class BatchSettings:
    """The node's batch service (``timeslice-verl batch serve``) and its clients (``batch submit``, ``status``)."""

    host: str = "127.0.0.1"
    """Where the service listens (and its clients find it); loopback: only this node reaches it."""
    port: int = 8090
    store: StoreKind = StoreKind["sqlite"]
    """Where the queue is: ``sqlite`` (the file ``db``: one node) or ``postgresql`` (one queue for a cluster: any number
    of ``batch serve --api-only`` replicas and a ``batch feed`` per node; its DSN from ``TIMESLICE_BATCH_DSN`` or
    ``dsn_file``, never on a command line)."""
    db: str = ""
    """Its SQLite file; empty: ``$XDG_STATE_HOME/timeslice-verl/batch.sqlite`` (``~/.local/state/…``)."""
    dsn_file: str = ""
    """``store=postgresql``: a file only you can read holding the DSN (``TIMESLICE_BATCH_DSN`` replaces it)."""
    postgresql: PostgresBounds = field(default_factory=PostgresBounds)  # every wait on the server bounded
    lease_s: float = 30.0
    """How long a line a feeder claimed stays its own without a renewal: a node that goes away gives its lines back
    after this."""
    key_file: str = ""
    """Its API key, made 0600 at first start, read by the ``batch`` commands; empty: ``batch.key`` beside the default
    database. ``TIMESLICE_BATCH_API_KEY`` replaces it."""
    tenant_urls: List[str] = field(default_factory=list)
    """The vLLM servers it feeds; empty: the agent's (``timeslice.tenant.urls``)."""
    follow_agent: bool = True
    """Send lines only while the node's agent says the tenant owns the GPU (off: whenever the tenant answers)."""
    concurrency: int = 256  # lines in flight at the start (a full running batch from the first valley); then the number follows the tenant
    max_concurrency: int = 512
    """At most this many in flight. vLLM captures CUDA graphs for decode batches up to 512 by default
    (``min(2 × max_num_seqs, 512)``) and runs larger ones without, generating markedly fewer tokens past that
    size. Raise both together (``max_cudagraph_capture_size``)."""
    adapt_concurrency: bool = True
    """Follow vLLM's ``/metrics``: its running batch full, a short queue inside it (off: always ``concurrency``)."""
    spread: bool = False
    """Release sends at the limit's pace (the limit per answer's time), not all at once: answers of one length sent
    together come back together, and vLLM's front end leaves the GPU idle between the waves. Off: vLLM's front end
    in four processes (``--api-server-count 4``) removes the waves without it; spreading itself is measured by
    ``benchmarks/harvest.py --spread``."""
    max_attempts: int = 5  # tries of a line failed for a reason not its own (an abort, a kill, a restart); then it fails
    resume_partial: bool = True  # a line a yield cut goes on from what it generated (off: again from the start)
    max_file_mb: float = 200.0  # the largest input file accepted
    upload_idle_s: float = 600.0  # chunks of an upload not written to this long, its file never made, are dropped
    chunk_mb: float = 4.0  # the most of a file an upload, a download or a batch's creation holds at once
    request_timeout_s: float = 600.0
    poll_s: float = 0.5  # how often an agent without watch_owner is asked who owns the GPU


@dataclass
class ValidateSettings:
    """Validation in the valleys: each due version pushed into the policy tenant and run as a batch (off by default)."""

    enable: bool = False
    every: int = 0  # validate every this many versions; 0: verl's trainer.test_freq
    policy_url: str = ""  # the policy tenant: a vLLM started with weight transfer, on the trainer's GPU
    priority: int = 100  # the validation batches' priority (users' batches: 0)
    service_url: str = ""  # the batch service (default http://{batch.host}:{batch.port})
    poll_s: float = 2.0  # how often a running validation's batch is looked at
    source: str = "timeslice_verl.validate.verl_source:ranks"
    """The trainer's weights: ``package.module:factory``, called with the trainer, returning a WeightSource (the
    default: verl's actor ranks, rank 0 keeping a due version on its GPU for a policy tenant on the same GPU)."""
    finish_s: float = 600.0  # at the end of training, how long the last validations may still take


@dataclass
class TimelineSettings:
    path: str = "timeslice-timeline.jsonl"
    """JSONL file the timeline plugin appends events and agent transitions to."""


@dataclass
class MetricsSettings:
    prefix: str = "timeslice/"
    """Prefix of the keys the metrics plugin adds to the trainer's metrics dict."""


@dataclass
class TimesliceSettings:
    """The whole ``timeslice`` section."""

    enabled: bool = True
    job: str = "timeslice"
    """Job name; worker processes carry it in ``TIMESLICE_JOB`` (the option sets both)."""
    adapter: Adapter = Adapter["auto"]
    """How events are fired from verl: ``stock`` (PyPI verl's fully-async trainer), ``v1`` (verl's v1
    ``separate_async`` trainer), ``hooked`` (verl builds with fully-async lifecycle hooks; ``fork``, its former name, still works) or ``auto``."""
    agent: AgentSettings = field(default_factory=AgentSettings)
    tenant: TenantSettings = field(default_factory=TenantSettings)
    handoff: HandoffSettings = field(default_factory=HandoffSettings)
    plugins: PluginSettings = field(default_factory=PluginSettings)
    timeline: TimelineSettings = field(default_factory=TimelineSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    batch: BatchSettings = field(default_factory=BatchSettings)
    validate: ValidateSettings = field(default_factory=ValidateSettings)


CHOICES: dict[str, tuple[Any, ...]] = {"tenant.sleep_level": (1, 2)}
DAY_S = 86400.0
RANGES: dict[str, tuple[float, float, bool]] = {
    # key: (lowest, highest, lowest allowed?) — every float setting; nan and infinities are never meaningful
    "agent.driver_timeout_s": (0.0, 30 * DAY_S, False),
    "agent.reattach_grace_s": (0.0, 30 * DAY_S, True),
    "agent.connect_timeout_s": (0.0, 30 * DAY_S, False),
    "agent.park_overhead_gib": (0.0, 1024.0, True),
    "agent.shutdown_timeout_s": (0.0, DAY_S, False),
    "tenant.request_timeout_s": (0.0, DAY_S, False),
    "batch.lease_s": (0.0, DAY_S, False),
    "tenant.awake_margin_gib": (0.0, 1024.0, True),
    "tenant.drain_timeout_s": (0.0, 30 * DAY_S, False),
    "tenant.reclaim_deadline_s": (0.0, DAY_S, True),
    "tenant.pause_grant_s": (0.0, 3600.0, True),
    "tenant.probe_interval_s": (0.0, 3600.0, True),
    "tenant.probe_timeout_s": (0.0, 600.0, False),
    "handoff.acquire_timeout_s": (0.0, 30 * DAY_S, True),
    "handoff.prepare_lead_s": (0.0, DAY_S, True),
    "handoff.break_even_margin": (0.0, 1000.0, True),
    "handoff.late_cost": (0.0, 1e6, False),
    "batch.max_file_mb": (0.0, 1e6, False),
    "batch.upload_idle_s": (0.0, 30 * DAY_S, False),
    **PG_RANGES,
    "batch.chunk_mb": (0.0, 1024.0, False),
    "batch.request_timeout_s": (0.0, DAY_S, False),
    "batch.poll_s": (0.0, 60.0, False),
    "validate.poll_s": (0.0, 3600.0, False),
    "validate.finish_s": (0.0, DAY_S, True),
}
"""The meaningful range of each float setting (0 where it is allowed means "off" or "no bound", as the key says)."""


def load_settings(section: Any = None) -> TimesliceSettings:
    """Validate a ``timeslice`` section (DictConfig, dict or None) into :class:`TimesliceSettings`."""
    schema = OmegaConf.structured(TimesliceSettings)
    if section is None:
        section = {}
    if isinstance(section, TimesliceSettings):
        return section
    if not isinstance(section, (dict, DictConfig)):
        raise ConfigError(SECTION, f"must be a mapping, got {type(section).__name__}")
    try:
        if isinstance(section, DictConfig):
            section = OmegaConf.to_container(section, resolve=True)
        _no_dsn_in_store(section)
        merged = OmegaConf.merge(schema, section)
        settings: TimesliceSettings = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or getattr(exc, "key", "") or ""
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(_full_key(key), msg) from None
    _check_values(settings)
    return settings


def _check_values(settings: TimesliceSettings) -> None:
    for key, allowed in CHOICES.items():
        value = setting_at(settings, key)
        if value not in allowed:
            raise ConfigError(_full_key(key), f"{value!r} is not one of {', '.join(map(repr, allowed))}")
    for key, (low, high, low_ok) in RANGES.items():
        value = float(setting_at(settings, key))
        if not math.isfinite(value) or value > high or value < low or (value == low and not low_ok):
            bound = f">= {low:g}" if low_ok else f"> {low:g}"
            raise ConfigError(_full_key(key), f"must be a number {bound} and <= {high:g}, got {value}")
    if not valid_job(settings.job):
        raise ConfigError(
            _full_key("job"), f"{settings.job!r} is not a job name (letters, digits, '.', '_', '-'; max 64)"
        )
    if any(g < 0 for g in settings.agent.gpus):
        raise ConfigError(_full_key("agent.gpus"), f"GPU indices must be >= 0, got {settings.agent.gpus}")
    for key in ("agent.metrics_port", "batch.port"):
        if not 0 <= setting_at(settings, key) <= 65535:
            raise ConfigError(_full_key(key), f"not a TCP port: {setting_at(settings, key)}")
    for key, low in (("batch.concurrency", 1), ("batch.max_concurrency", 1), ("batch.max_attempts", 1)):
        if not low <= setting_at(settings, key) <= 100_000:
            raise ConfigError(_full_key(key), f"must be between {low} and 100000, got {setting_at(settings, key)}")
    _check_urls(settings)
    _check_validate(settings)
    check_bounds(settings.batch.postgresql)
    for entry in settings.plugins.modules:
        if not re.match(r"^[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?$", entry):
            raise ConfigError(_full_key("plugins.modules"), f"{entry!r} is not 'package.module[:attr]'")


def section_of(config: Any) -> Any | None:
    """The ``timeslice`` section of a verl config (DictConfig or dict), or None when absent."""
    if config is None:
        return None
    try:
        if isinstance(config, DictConfig):
            return OmegaConf.select(config, SECTION, default=None)
        if isinstance(config, dict):
            return config.get(SECTION)
    except OmegaConfBaseException:
        return None
    return None


def enabled_settings(config: Any) -> TimesliceSettings | None:
    """Validated settings when the section is present and enabled, else None (inert)."""
    section = section_of(config)
    if section is None:
        return None
    settings = load_settings(section)
    return settings if settings.enabled else None
