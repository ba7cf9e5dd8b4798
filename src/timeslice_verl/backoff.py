"""One backoff for every retry of the project: a first wait that grows by a factor up to a bound.

Who uses it: a batch line sent again (:meth:`Backoff.after` its failed tries), the batch store while it cannot be
written, a tenant move that failed, a step of the reclaim ladder, the tenant supervisor's restarts (reset after a
stable run) and the agent client's reconnects (:meth:`Backoff.next` from the current wait)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    first_s: float
    most_s: float
    factor: float = 2.0

    def after(self, failures: int) -> float:
        """The wait after ``failures`` failures in a row (1: the first wait)."""
        return min(self.most_s, self.first_s * self.factor ** max(0, failures - 1))

    def next(self, current_s: float) -> float:
        """The wait after one more failure, from the current one (0: none yet); never under the first."""
        return min(self.most_s, max(self.first_s, current_s * self.factor))


__all__ = ["Backoff"]
