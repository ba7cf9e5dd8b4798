"""What an owner's keys share, read from the key file's fields: its weight in the fair share between owners of one
priority, its quotas of generated tokens per sliding hour and day, and its quota of valley GPU-seconds per day.

``weight=W`` (default 1; 0 < W ≤ 1000): under saturation the owners of one priority hold lines in flight — and so,
as vLLM generates a token per running sequence per step, receive tokens — in proportion to their weights.
``tokens_per_hour=N``, ``tokens_per_day=N`` (default: none): once the tokens the owner's answers generated over the
last hour (day) reach N, its new batches answer 429 with ``Retry-After`` and its running batches pause (their lines
are not claimed) until the window frees enough; nothing fails for it. ``gpu_seconds_per_day=S`` (default: none): the
same once the valley GPU-seconds its lines received over the last day (:mod:`~timeslice_verl.batch.usage`) reach S.
Several keys may name one owner: a field given
on more than one of its lines must say the same on each (one owner, one policy).
``refuse_late=true`` (default false): a new batch whose ETA (:mod:`~timeslice_verl.batch.estimates`) is past the
end of its ``completion_window`` is refused (400) instead of made and flagged ``late``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields, replace


class PolicyError(ValueError):
    """A policy field that cannot be read: the message names the field and what it takes."""


MAX_WEIGHT = 1000.0
MAX_TOKENS = 10**15
MAX_GPU_SECONDS = 10**9
GPU_DAY = "gpu_seconds_per_day"


class Window(enum.Enum):
    """A quota's sliding window, in seconds."""

    hour = 3600
    day = 86400

    @property
    def field(self) -> str:
        return f"tokens_per_{self.name}"


@dataclass(frozen=True)
class OwnerPolicy:
    """An owner's share and quotas (None: no quota)."""

    weight: float = 1.0
    tokens_per_hour: int | None = None
    tokens_per_day: int | None = None
    gpu_seconds_per_day: float | None = None
    refuse_late: bool = False
    """A new batch that would end past its window is refused rather than flagged."""

    def quota(self, window: Window) -> int | None:
        return self.tokens_per_hour if window is Window.hour else self.tokens_per_day

    @property
    def limited(self) -> bool:
        return self.tokens_per_hour is not None or self.tokens_per_day is not None or \
            self.gpu_seconds_per_day is not None

    def __str__(self) -> str:
        given = [f"{f.name}={getattr(self, f.name):g}" if f.name in ("weight", GPU_DAY) else
                 f"{f.name}={str(getattr(self, f.name)).lower()}" if f.name == "refuse_late" else
                 f"{f.name}={getattr(self, f.name)}"
                 for f in fields(self) if getattr(self, f.name) != f.default]
        return " ".join(given) or "weight=1"


NAMES = tuple(f.name for f in fields(OwnerPolicy))
"""The key file's policy fields."""
DEFAULT = OwnerPolicy()


def parse_field(name: str, text: str) -> float | int | bool:
    """One policy field's value, or :class:`PolicyError` naming the field."""
    if name == "refuse_late":
        if text not in ("true", "false"):
            raise PolicyError(f"refuse_late={text!r} is not true or false (e.g. refuse_late=true)")
        return text == "true"
    if name == "weight":
        try:
            weight = float(text)
        except ValueError:
            weight = math.nan
        if not 0 < weight <= MAX_WEIGHT:  # NaN fails too
            raise PolicyError(f"weight={text!r} is not a number above 0 and at most {MAX_WEIGHT:g} (e.g. weight=3)")
        return weight
    if name == GPU_DAY:
        try:
            seconds = float(text)
        except ValueError:
            seconds = math.nan
        if not 0 < seconds <= MAX_GPU_SECONDS:
            raise PolicyError(f"{name}={text!r} is not a number of seconds above 0 and at most {MAX_GPU_SECONDS} "
                              f"(e.g. {name}=3600)")
        return seconds
    try:
        tokens = int(text)
    except ValueError:
        tokens = 0
    if not 1 <= tokens <= MAX_TOKENS:
        raise PolicyError(f"{name}={text!r} is not a whole number of tokens from 1 to {MAX_TOKENS} "
                          f"(e.g. {name}=200000)")
    return tokens


def with_field(policy: OwnerPolicy, name: str, text: str) -> OwnerPolicy:
    """``policy`` with field ``name`` read from ``text``."""
    return replace(policy, **{name: parse_field(name, text)})


__all__ = ["DEFAULT", "GPU_DAY", "MAX_GPU_SECONDS", "MAX_TOKENS", "MAX_WEIGHT", "NAMES", "OwnerPolicy", "PolicyError", "Window", "parse_field",
           "with_field"]
