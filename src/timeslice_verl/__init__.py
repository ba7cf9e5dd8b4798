"""timeslice-verl: lend the idle GPU of a verl fully-async trainer to a co-resident vLLM server.

The trainer keeps absolute priority: lifecycle events fired from verl (``hookspecs``) reach hook
plugins through a pluggy manager built in the trainer process (``manager``, ``lifecycle``); the
bundled agent plugin asks the node's snapshot agent (``agent``) to freeze the trainer's GPU
processes and wake vLLM while the trainer waits for rollout samples, and back.

Importing this package is cheap: it needs neither verl, vLLM nor torch.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("timeslice-verl")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__", "hookimpl"]


def __getattr__(name: str) -> Any:
    # Lazy, so the agent (which must not import pluggy) can import the package's plain modules.
    if name == "hookimpl":
        from timeslice_verl.hooks.spec import hookimpl

        return hookimpl
    raise AttributeError(f"module 'timeslice_verl' has no attribute {name!r}")
