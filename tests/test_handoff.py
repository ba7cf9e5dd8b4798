"""The trainer-side handoff sequence (timeslice_verl.handoff.sequence.Handoff) against recorded ranks and agent."""

from __future__ import annotations

import re

import pytest

from timeslice_verl.agent.client import AgentError
from timeslice_verl.handoff.options import HandoffOptions
from timeslice_verl.handoff.sequence import Handoff


class Calls(list):
    def __call__(self, name: str):
        self.append(name)


class Ranks:
    def __init__(self, calls: Calls, fail: str = "") -> None:
        self.calls, self.fail = calls, fail

    def _do(self, name: str, report: dict) -> list[dict]:
        self.calls(name)
        if name == self.fail:
            raise RuntimeError(f"rank 1: {name} failed")
        return [report]

    def can_park(self) -> bool:
        return True

    def park_reserve(self):
        return self._do("park_reserve", {"pid": 11, "pinned": 1})

    def park(self):
        return self._do("park", {"pid": 11, "parked": 5, "kept": 1, "seconds": 0.1})

    def unpark(self):
        return self._do("unpark", {"pid": 11, "parked": 5, "kept": 1, "seconds": 0.1})

    def release_caches(self):
        return self._do("release_caches", {"pid": 11})

    def local_pids(self):
        return [11]

    def agree(self, what: str, error: BaseException | None) -> None:
        self.calls(f"agree:{what}")
        if error is not None:
            raise error


class Agent:
    def __init__(self, calls: Calls, refuse: str = "") -> None:
        self.calls, self.refuse = calls, refuse

    def _do(self, name: str) -> dict:
        self.calls(f"agent.{name}")
        if name == self.refuse:
            raise AgentError("fault", f"{name} refused")
        return {"transitions": [], "thawed": name == "acquire"}

    def acquire(self, job, timeout_s=None):
        return self._do("acquire")

    def release(self, job, done=False, swap="checkpoint", parked=None):
        return self._do("release_done" if done else f"release:{swap}")

    def prepare(self, job):
        return self._do("prepare")

    def register_pids(self, job, pids):
        return self._do("register_pids")

    def close(self):
        self.calls("agent.close")


def handoff(swap: str, fail: str = "", refuse: str = "", **options) -> tuple[Handoff, Calls]:
    calls = Calls()
    h = Handoff("j", client=Agent(calls, refuse), ranks=Ranks(calls, fail),
                options=HandoffOptions(swap=swap, prepare=False, **options))
    return h, calls


CASES = [
    # swap, what fails, steps, the calls in order
    ("park", "", "release acquire", ["park", "agent.release:park", "agent.acquire", "agree:acquire", "unpark", "agree:unpark"]),
    ("checkpoint", "", "release acquire", ["release_caches", "agent.release:checkpoint", "agent.acquire", "agree:acquire"]),
    ("park", "park", "release", ["park", "unpark"]),  # a rank could not park: every rank unparks, nothing released
    ("park", "", "release done", ["park", "agent.release:park", "agent.acquire", "agree:acquire", "unpark", "agree:unpark",
                                  "agent.release_done", "agree:release"]),
    ("park", "", "release crash", ["park", "agent.release:park", "agent.acquire", "agree:acquire", "unpark", "agree:unpark",
                                   "agent.release:checkpoint"]),
    ("checkpoint", "", "release crash", ["release_caches", "agent.release:checkpoint", "agent.release:checkpoint"]),
]


@pytest.mark.parametrize("swap, fail, steps, expected", CASES, ids=[f"{c[0]}:{c[2]}:{c[1] or 'ok'}" for c in CASES])
def test_the_sequence(swap, fail, steps, expected):
    h, calls = handoff(swap, fail)
    for step in steps.split():
        {"release": lambda: h.release("weight_sync_end"), "acquire": lambda: h.acquire("pre_train_step"),
         "done": lambda: h.done("stop"), "crash": lambda: h.crash("exception:fit")}[step]()
    assert calls == expected


def test_after_a_release_the_ranks_exchange_nothing():
    """The agent may stop any rank once it has the release (the CPU test backend stops them outright): a
    rank waiting on a stopped peer would never return, so nothing is agreed after the agent's release."""
    for swap in ("park", "checkpoint", "park+checkpoint"):
        h, calls = handoff(swap)
        h.release("weight_sync_end")
        after = calls[calls.index(next(c for c in calls if c.startswith("agent.release"))) + 1:]
        assert after == [], (swap, calls)


def test_a_refused_release_is_logged_and_the_next_acquire_finds_the_gpu_held():
    h, calls = handoff("park", refuse="release:park")
    out = h.release("weight_sync_end")
    assert out is not None and not out.ok and "release:park refused" in out.detail
    h.acquire("pre_train_step")
    assert "agent.acquire" in calls


def test_a_refused_acquire_raises_and_the_ranks_agree_on_it():
    h, calls = handoff("park", refuse="acquire")
    h.release("weight_sync_end")
    with pytest.raises(AgentError, match="acquire refused"):
        h.acquire("pre_train_step")
    assert calls[-1] == "agree:acquire"
    assert h.parked, "no rank unparks without the GPU"


def test_begin_reads_the_ranks_memory_pins_once_and_registers_the_ranks():
    h, calls = handoff("park")
    h.begin()
    assert calls == ["release_caches", "park_reserve", "agent.register_pids"]
    assert h.forecast.round_trip_estimate is not None, "the first valleys are judged by an estimate of the round trip"


@pytest.mark.parametrize("swap", ["park", "park+checkpoint", "resident"])
def test_a_swap_mode_that_needs_ranks_is_refused_without_them(swap):
    with pytest.raises(ValueError, match=re.escape(f"swap={swap} needs trainer ranks that move their own tensors")):
        Handoff("j", client=None, ranks=None, options=HandoffOptions(swap=swap))


def test_a_swap_mode_that_does_not_exist_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="timeslice.handoff.swap: 'fast' is not one of"):
        Handoff("j", client=None, ranks=None, options=HandoffOptions(swap="fast"))


def test_auto_without_ranks_is_checkpoint():
    assert Handoff("j", client=None, ranks=None).swap == "checkpoint"
