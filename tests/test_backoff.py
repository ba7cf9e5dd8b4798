"""One backoff for every retry: a first wait growing by a factor up to a bound."""

from __future__ import annotations

import pytest

from timeslice_verl.backoff import Backoff


@pytest.mark.parametrize("backoff, failures, wait", [
    (Backoff(0.5, 30.0), 1, 0.5), (Backoff(0.5, 30.0), 3, 2.0), (Backoff(0.5, 30.0), 12, 30.0),
    (Backoff(1.0, 60.0, factor=3.0), 3, 9.0), (Backoff(0.5, 30.0), 0, 0.5),
])
def test_the_wait_after_failures_in_a_row(backoff, failures, wait):
    assert backoff.after(failures) == wait


@pytest.mark.parametrize("backoff, current, wait", [
    (Backoff(0.5, 30.0), 0.0, 0.5),       # none yet: the first
    (Backoff(0.5, 30.0), 4.0, 8.0),
    (Backoff(0.5, 30.0), 20.0, 30.0),     # bounded
    (Backoff(30.0, 300.0), 1.0, 30.0),    # a harder failure after an easy one: never under its own first wait
])
def test_the_next_wait_from_the_current_one(backoff, current, wait):
    assert backoff.next(current) == wait
