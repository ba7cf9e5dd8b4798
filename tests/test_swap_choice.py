"""``timeslice.handoff.swap=auto``: park where every host can pin its ranks' state, else checkpoint."""

from __future__ import annotations

import pytest

from test_handoff import Agent, Calls, Ranks
from timeslice_verl.handoff import Handoff
from timeslice_verl.swap_choice import choose, parkable

GiB = 2**30


def rank(host: str, live_gib: float, available_gib: float) -> dict:
    return {"host": host, "live_after": int(live_gib * GiB), "host_available": int(available_gib * GiB)}


@pytest.mark.parametrize(
    ("reports", "swap", "why"),
    [
        (None, "checkpoint", "the ranks cannot park"),
        ([], "checkpoint", "no rank reported its memory"),
        ([rank("n1", 0, 128)], "checkpoint", "the ranks hold no GPU memory (no CUDA here?)"),
        ([rank("n1", 18, 128)], "park", "n1 pins 18.0 GiB of 128.0 GiB available"),
        # 18 GiB × 1.25 + 4 GiB = 26.5 GiB > 24 GiB
        ([rank("n1", 18, 24)], "checkpoint", "park would pin host RAM the node cannot spare: n1 needs 18.0 GiB pinned, "
                                             "24.0 GiB available; set timeslice.handoff.swap=park to force it"),
        # two ranks on one host add up; the other host is fine, one short host decides
        ([rank("n1", 10, 28), rank("n1", 10, 28), rank("n2", 10, 28)], "checkpoint",
         "park would pin host RAM the node cannot spare: n1 needs 20.0 GiB pinned, 28.0 GiB available; "
         "set timeslice.handoff.swap=park to force it"),
        ([rank("n1", 10, 40), rank("n2", 10, 40)], "park", "n1 pins 10.0 GiB of 40.0 GiB available; "
                                                            "n2 pins 10.0 GiB of 40.0 GiB available"),
        ([rank("n1", 1, 0)], "checkpoint", "park would pin host RAM the node cannot spare: n1 needs 1.0 GiB pinned, "
                                           "0.0 GiB available; set timeslice.handoff.swap=park to force it"),
    ],
)
def test_choose(reports, swap, why):
    assert choose(reports) == (swap, why)


def test_parkable_is_what_choose_accepts():
    most = parkable(64 * GiB)
    assert choose([rank("n", most / GiB, 64)])[0] == "park"
    assert choose([rank("n", most / GiB + 0.01, 64)])[0] == "checkpoint"


class MemoryRanks(Ranks):
    def __init__(self, calls: Calls, available_gib: float) -> None:
        super().__init__(calls)
        self.available = available_gib

    def release_caches(self):
        self.calls("release_caches")
        return [rank("n1", 18, self.available)]


@pytest.mark.parametrize(("available", "swap", "pinned"), [(128, "park", True), (20, "checkpoint", False)])
def test_the_handoff_resolves_auto_when_the_model_is_loaded(available, swap, pinned):
    calls = Calls()
    h = Handoff("j", client=Agent(calls), ranks=MemoryRanks(calls, available), swap="auto", prepare=False)
    assert h.swap == "auto"
    h.begin()
    assert h.swap == swap and ("park_reserve" in calls) == pinned


def test_auto_without_ranks_is_checkpoint():
    assert Handoff("j", client=None, ranks=None, swap="auto").swap == "checkpoint"
