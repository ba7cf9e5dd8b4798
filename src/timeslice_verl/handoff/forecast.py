"""The trainer's idle valleys as the handoff sees them: whether one is worth lending, and when it ends.

Pure (no I/O, no clock): :class:`~timeslice_verl.handoff.Handoff` feeds it what it measured and asks.

* **Break-even.** A handoff costs a round trip — park, the agent's freeze, the tenant's wake and its
  yield, the thaw, the unpark — measured on this node in this run. A valley is lent only when it is
  expected to last ``margin`` times that; a valley shorter than the round trip would leave the tenant
  nothing and cost the trainer the round trip.
* **The valley's length** comes from verl's own signals: the *backlog* (samples queued for the next
  step against the samples it needs: fully-async's message queue, v1's replay buffer) and the
  production rate seen in recent valleys (seconds per missing sample). A full backlog means no valley.
* **Prepare.** The way back (yield, thaw, unpark) is started ``lead`` seconds before the valley is
  expected to end: with a backlog, when the missing samples times the per-sample time fall under the
  lead; without one (an SPMD trainer), after the shortest recent queue wait minus the lead.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

MARGIN = 1.5
"""How many round trips a valley must be expected to last to be lent (``timeslice.handoff.break_even_margin``)."""


@dataclass(frozen=True)
class Decision:
    release: bool
    reason: str
    expected_s: float | None = None
    """The valley's expected length (None when there is nothing to go on)."""


class ValleyForecast:
    """What the handoff learned of this run's valleys, and the rules it applies (see the module)."""

    def __init__(self, lead_s: float = 0.0, margin: float = MARGIN, history: int = 5) -> None:
        self.lead_s = lead_s
        self.margin = margin
        self.waits: deque[float] = deque(maxlen=history)
        self.per_sample_s: deque[float] = deque(maxlen=history)
        self.round_trips: deque[float] = deque(maxlen=history)
        self.thaw_s: float | None = None
        self._missing: int | None = None
        """Samples missing when the last valley began (at the release or its skip)."""

    # ------------------------------------------------------------------ what was measured

    def observe_wait(self, seconds: float) -> None:
        """The trainer waited ``seconds`` for the batch of the valley that just ended."""
        if seconds < 0:
            return
        self.waits.append(seconds)
        if self._missing and seconds > 0:
            self.per_sample_s.append(seconds / self._missing)
        self._missing = None

    def observe_thaw(self, seconds: float) -> None:
        """How long the last way back took: the tenant's yield, the thaw and the ranks' unpark."""
        if seconds > 0:
            self.thaw_s = seconds

    def observe_round_trip(self, seconds: float) -> None:
        """What one whole handoff cost (out and back)."""
        if seconds > 0:
            self.round_trips.append(seconds)

    # ------------------------------------------------------------------ the rules

    def round_trip(self) -> float | None:
        trips = list(self.round_trips)  # read while the way back's thread may append
        return statistics.median(trips) if trips else None

    def expected(self, queued: int, required: int) -> float | None:
        """The valley's expected length with ``queued`` of ``required`` samples ready; None without a rate."""
        missing = max(0, required - queued)
        if missing == 0:
            return 0.0
        rates = list(self.per_sample_s)
        return missing * statistics.median(rates) if rates else None

    def decide(self, backlog: tuple[int, int] | None) -> Decision:
        """Lend the GPU for the valley that starts now? ``backlog``: (queued, required), or None if unknown."""
        if backlog is None:
            return Decision(True, "no backlog signal")
        queued, required = backlog
        self._missing = max(0, required - queued)
        if self.margin <= 0:
            return Decision(True, "every valley is lent (break_even_margin=0)")
        if required > 0 and queued >= required:
            return Decision(False, f"next batch queued ({queued}/{required} samples)", 0.0)
        expected = self.expected(queued, required)
        trip = self.round_trip()
        if expected is None or trip is None:
            return Decision(True, "learning the valleys", expected)
        if expected < self.margin * trip:
            return Decision(False, f"valley {expected:.2f} s expected ({queued}/{required} samples) < "
                                   f"{self.margin:g} × round trip {trip:.2f} s", expected)
        return Decision(True, f"valley {expected:.2f} s expected ≥ {self.margin:g} × round trip {trip:.2f} s", expected)

    def lead(self) -> float | None:
        """How long before the valley's end the way back starts."""
        if self.lead_s > 0:
            return self.lead_s
        return None if self.thaw_s is None else self.thaw_s * 1.2

    def due_in(self, backlog: tuple[int, int] | None, since_s: float = 0.0) -> float | None:
        """Seconds until the way back should start (0: now); None when nothing tells. ``since_s``: how long
        the backlog has stood still — the next sample is that far along already. Without it a forecast is
        late by up to one sample's interval, which with long responses (samples seconds apart) is longer
        than the lead itself."""
        lead = self.lead()
        if lead is None:
            return None
        if backlog is not None:
            expected = self.expected(*backlog)
            if expected is not None:
                if expected > 0:
                    expected = max(0.0, expected - since_s)
                return max(0.0, expected - lead)
        waits = list(self.waits)
        return max(0.0, min(waits) - lead) if waits else None

    def delay(self) -> float | None:
        """Without a backlog signal: seconds from a release to the prepare."""
        return self.due_in(None)


PreparePlanner = ValleyForecast
"""The former name (0.2): the prepare timer was all there was."""

__all__ = ["MARGIN", "Decision", "PreparePlanner", "ValleyForecast"]
