"""Owners' quotas held against what their answers generated: a new batch over quota is refused (429 with
``Retry-After``), and a running batch of an owner over quota pauses — the claim passes its lines over — until the
sliding window frees enough; nothing fails for a quota.

The valley GPU-seconds per day (``gpu_seconds_per_day``) are held the same way, read from the minutes the feeders
wrote (:mod:`~timeslice_verl.batch.usage`; ``owner_gpu_day``, ``owner_gpu_frees``).

Usage is read from the database (the catalogue's ``owner_usage`` and ``owner_frees``: the tokens stored with the
lines, each window on the database's clock), so every API replica and feeder of a cluster sees the same figure, and a
node whose clock is off neither shortens nor stretches an owner's hour or day. A claim asks at most every
``check_s`` per owner (the answers in flight meanwhile may carry an owner a little past its quota: they are not cut).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from timeslice_verl.batch.engine import Engine
from timeslice_verl.batch.policy import DEFAULT, GPU_DAY, OwnerPolicy, Window

CHECK_S = 5.0
"""How long a claim trusts an owner's usage before it reads it again."""


@dataclass(frozen=True)
class Over:
    """An owner over a quota: which window, its tokens there and its quota, and when enough of them leave it."""

    window: Window
    used: float
    limit: float
    retry_after_s: int
    field: str = ""
    """The policy's field (``tokens_per_…`` by default, or ``gpu_seconds_per_day``)."""

    def __str__(self) -> str:
        if self.field == GPU_DAY:
            return (f"{self.used:.1f} valley GPU-seconds used in the last day, at or over its {GPU_DAY}="
                    f"{self.limit:g}; retry in {self.retry_after_s} s")
        return (f"{self.used} tokens generated in the last {self.window.name}, at or over its {self.window.field}="
                f"{self.limit}; retry in {self.retry_after_s} s")


class Quotas:
    """Usage and quotas of owners over one engine; ``policy_of``: an owner's policy now (the key ring's), for the
    claim, which sees owners, not keys."""

    def __init__(self, engine: Engine, policy_of: Callable[[str], OwnerPolicy] = lambda owner: DEFAULT,
                 check_s: float = CHECK_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine, self.policy_of, self.check_s, self.clock = engine, policy_of, check_s, clock
        self._seen: dict[str, tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def usage(self, owner: str) -> dict[Window, int]:
        """``owner``'s tokens over the last hour and day."""
        day = Window.day.value
        row = self.engine.query(self.engine.dialect.sql("owner_usage"), (Window.hour.value, day, owner, day))[0]
        return {Window.hour: int(row["hour"]), Window.day: int(row["day"])}

    def gpu_day(self, owner: str) -> float:
        """``owner``'s valley GPU-seconds over the last day."""
        return float(self.engine.query(self.engine.dialect.sql("owner_gpu_day"), (owner,))[0]["gpu_s"])

    def _gpu_over(self, owner: str, policy: OwnerPolicy) -> Over | None:
        limit = policy.gpu_seconds_per_day
        if limit is None or (used := self.gpu_day(owner)) < limit:
            return None
        left = used
        for row in self.engine.query(self.engine.dialect.sql("owner_gpu_frees"), (owner,)):
            left -= float(row["gpu_s"])
            if left < limit:
                return Over(Window.day, used, limit, max(1, math.ceil(float(row["frees_in"]))), GPU_DAY)
        return Over(Window.day, used, limit, Window.day.value, GPU_DAY)

    def over(self, owner: str, policy: OwnerPolicy) -> Over | None:
        """The quota ``owner`` is over (the one that frees last), or None."""
        if not policy.limited:
            return None
        worst = self._gpu_over(owner, policy)
        used = self.usage(owner)
        if not self._exceeds(policy, used):
            return worst
        for window in Window:
            limit = policy.quota(window)
            if limit is None or used[window] < limit:
                continue
            found = Over(window, used[window], limit, self._frees(owner, window, used[window], limit))
            if worst is None or found.retry_after_s > worst.retry_after_s:
                worst = found
        return worst

    @staticmethod
    def _exceeds(policy: OwnerPolicy, used: dict[Window, int]) -> bool:
        return any((limit := policy.quota(w)) is not None and used[w] >= limit for w in Window)

    def _frees(self, owner: str, window: Window, used: int, limit: int) -> int:
        """Seconds until the tokens of ``owner`` in ``window`` fall below ``limit`` (the oldest leave first)."""
        rows = self.engine.query(self.engine.dialect.sql("owner_frees"),
                                 (window.value, window.value, owner, window.value))
        for row in rows:
            used -= int(row["tokens"])
            if used < limit:
                return max(1, math.ceil(float(row["frees_in"])))
        return window.value  # answers recorded meanwhile: a whole window at most

    def weight(self, owner: str) -> float:
        return self.policy_of(owner).weight

    def paused(self, owners: Iterable[str]) -> set[str]:
        """Of ``owners``, those over a quota now (each read again once ``check_s`` passed since its last reading)."""
        now, out = self.clock(), set()
        for owner in set(owners):
            policy = self.policy_of(owner)
            if not policy.limited:
                continue
            with self._lock:
                seen = self._seen.get(owner)
            if seen is None or now - seen[0] >= self.check_s:
                seen = (now, self._exceeds(policy, self.usage(owner)) or (  # when it frees: the 429's question alone
                    policy.gpu_seconds_per_day is not None and self.gpu_day(owner) >= policy.gpu_seconds_per_day))
                with self._lock:
                    self._seen[owner] = seen
            if seen[1]:
                out.add(owner)
        return out


__all__ = ["CHECK_S", "Over", "Quotas"]
