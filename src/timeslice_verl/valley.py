"""The trainer's idle valleys as the handoff sees them: when the next batch is expected."""

from __future__ import annotations

from collections import deque


class PreparePlanner:
    """When to send ``prepare`` after a release, so the restore overlaps the end of the queue wait.

    The next batch is expected after the shortest of the recent queue waits (conservative: the
    trainer must not wait for its restore); the restore is expected to take ``lead_s`` if set,
    else the last measured way back (the tenant's yield, the thaw, the unpark) with a 20 % margin.
    Prepare fires at ``expected wait - expected restore`` after the release; with no history, not at all.
    """

    def __init__(self, lead_s: float = 0.0, history: int = 5) -> None:
        self.lead_s = lead_s
        self.waits: deque[float] = deque(maxlen=history)
        self.thaw_s: float | None = None

    def observe_wait(self, seconds: float) -> None:
        if seconds >= 0:
            self.waits.append(seconds)

    def observe_thaw(self, seconds: float) -> None:
        """How long the last handoff back took: the tenant's yield, the thaw and the ranks' unpark."""
        if seconds > 0:
            self.thaw_s = seconds

    def lead(self) -> float | None:
        if self.lead_s > 0:
            return self.lead_s
        return None if self.thaw_s is None else self.thaw_s * 1.2

    def delay(self) -> float | None:
        """Seconds from a release to the prepare; None when there is nothing to go on yet."""
        lead = self.lead()
        if lead is None or not self.waits:
            return None
        return max(0.0, min(self.waits) - lead)


__all__ = ["PreparePlanner"]
