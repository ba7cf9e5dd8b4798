"""``timeslice.handoff.swap=auto``: resident where the trainer's tensors and the awake tenant fit side by side, else
park where every host can pin its ranks' state, else checkpoint; and what a round trip of each should cost."""

from __future__ import annotations

import json

import pytest

from test_handoff import Agent, Calls, Ranks
from timeslice_verl.names import SwapMode
from timeslice_verl.handoff.options import HandoffOptions
from timeslice_verl.handoff.sequence import Handoff
from timeslice_verl.handoff.swap_choice import (
    TENANT_S,
    agent_figures,
    choose,
    parkable,
    resident_room,
    round_trip_estimate,
)

GiB = 2**30
H200 = 141 * GiB


def rank(host: str, live_gib: float, available_gib: float, used_gib: float | None = None, total: int = H200,
         pid: int = 7) -> dict:
    out = {"pid": pid, "host": host, "live_after": int(live_gib * GiB), "host_available": int(available_gib * GiB)}
    if used_gib is not None:
        out.update(device_used=int(used_gib * GiB), device_total=total)
    return out


TENANT_50 = {"tenant_bytes": 50 * GiB}


@pytest.mark.parametrize(
    ("reports", "agent", "swap", "why"),
    [
        (None, {}, "checkpoint", "the ranks cannot park"),
        ([], {}, "checkpoint", "no rank reported its memory"),
        ([rank("n1", 0, 128, 1)], TENANT_50, "checkpoint", "the ranks hold no GPU memory (no CUDA here?)"),
        # an H200: 18 GiB of tensors (19 with the context) beside a 50 GiB vLLM
        ([rank("n1", 18, 128, 19)], TENANT_50, "resident",
         "resident fits: pid 7 keeps 19.0 GiB, room 84.0 GiB beside a 50.0 GiB tenant"),
        # the tenant's footprint unknown (the agent has not measured it): park, the room on the host allows
        ([rank("n1", 18, 128, 19)], {}, "park", "resident: the tenant's footprint is not known (the agent has not "
                                                "measured it); park: n1 pins 18.0 GiB of 128.0 GiB available"),
        # no NVML in the rank: its footprint is unknown
        ([rank("n1", 18, 128)], TENANT_50, "park", "resident: pid 7 did not report its GPU footprint (no NVML?); park: n1 "
                                                   "pins 18.0 GiB of 128.0 GiB available"),
        # 90 GiB of tensors beside 50: no room; host RAM for park
        ([rank("n1", 89, 256, 90)], TENANT_50, "park", "resident does not fit: pid 7 keeps 90.0 GiB, room 84.0 GiB beside "
                                                       "a 50.0 GiB tenant; park: n1 pins 89.0 GiB of 256.0 GiB available"),
        # no room beside the tenant, no host RAM: checkpoint (18 × 1.25 + 4 = 26.5 GiB > 24)
        ([rank("n1", 18, 24, 19, total=64 * GiB)], TENANT_50, "checkpoint",
         "resident does not fit: pid 7 keeps 19.0 GiB, room 10.8 GiB beside a 50.0 GiB tenant; park would pin host RAM "
         "the node cannot spare: n1 needs 18.0 GiB pinned, 24.0 GiB available; set timeslice.handoff.swap=park to "
         "force it"),
        # two ranks on one host add up for park; one GPU short decides resident
        ([rank("n1", 10, 40, 11, pid=1), rank("n2", 10, 40, 95, pid=2)], TENANT_50, "park",
         "resident does not fit: pid 2 keeps 95.0 GiB, room 84.0 GiB beside a 50.0 GiB tenant; park: n1 pins 10.0 GiB "
         "of 40.0 GiB available; n2 pins 10.0 GiB of 40.0 GiB available"),
    ],
)
def test_choose(reports, agent, swap, why):
    assert choose(reports, agent) == (swap, why)


def test_parkable_is_what_choose_accepts():
    most = parkable(64 * GiB)
    assert choose([rank("n", most / GiB, 64)])[0] == "park"
    assert choose([rank("n", most / GiB + 0.01, 64)])[0] == "checkpoint"


def test_resident_room_keeps_a_margin():
    assert resident_room(H200, 50 * GiB) == H200 - 50 * GiB - int(H200 * 0.05)
    assert resident_room(40 * GiB, 50 * GiB) == 0


@pytest.mark.parametrize(
    ("status", "figures"),
    [
        ({}, {}),
        ({"agent": {"gpus": [0]}, "tenant": {"footprint": 50 * GiB, "yield_s": 0.14, "reclaim_s": 0.1},
          "bandwidth": {"checkpoint_gbps": 2.1, "restore_gbps": None}},
         {"tenant_bytes": 50 * GiB, "yield_s": 0.14, "reclaim_s": 0.1, "checkpoint_gbps": 2.1}),
        ({"agent": {"gpus": [0, 1]}, "tenant": {"footprint": 100 * GiB}}, {"tenant_bytes": 50 * GiB}),  # one per GPU
        ({"nodes": {"a": {}, "b": {"agent": {"gpus": [0]}, "tenant": {"footprint": GiB}}}}, {"tenant_bytes": GiB}),
    ],
)
def test_agent_figures(status, figures):
    assert agent_figures(status) == figures


@pytest.mark.parametrize(
    ("swap", "reports", "pinned", "agent", "seconds"),
    [
        ("resident", [rank("n", 18, 128, 19)], [], {"yield_s": 0.14, "reclaim_s": 0.1}, 0.24),
        ("resident", [rank("n", 18, 128, 19)], [], {}, TENANT_S),  # the tenant not timed yet: 2 s
        # park: 2 × 20 GB at the rank's measured 50 GB/s, plus the tenant
        ("park", [], [{"pinned": 20 * 10**9, "copy_gbps": 50.0}], {"yield_s": 0.2, "reclaim_s": 0.2}, 0.4 + 0.8),
        # checkpoint: 16 GB at the agent's measured 2 out and 5 back
        ("checkpoint", [rank("n", 15, 64, 16e9 / GiB)], [], {"checkpoint_gbps": 2.0, "restore_gbps": 5.0, "yield_s": 0.2,
                                                             "reclaim_s": 0.2}, 0.4 + 8.0 + 3.2),
    ],
)
def test_round_trip_estimate(swap, reports, pinned, agent, seconds):
    got, how = round_trip_estimate(SwapMode(swap), reports, pinned, agent)
    assert got == pytest.approx(seconds, rel=1e-6) and how


class MemoryRanks(Ranks):
    def __init__(self, calls: Calls, available_gib: float, used_gib: float | None = None) -> None:
        super().__init__(calls)
        self.available, self.used = available_gib, used_gib

    def release_caches(self):
        self.calls("release_caches")
        return [rank("n1", 18, self.available, self.used)]


class MeasuringAgent(Agent):
    def status(self):
        return {"agent": {"gpus": [0]}, "tenant": {"footprint": 50 * GiB}}


@pytest.mark.parametrize(("available", "used", "swap", "pinned"),
                         [(128, 19, "resident", False), (128, None, "park", True), (20, None, "checkpoint", False)])
def test_the_handoff_resolves_auto_when_the_model_is_loaded(available, used, swap, pinned):
    calls = Calls()
    h = Handoff("j", client=MeasuringAgent(calls), ranks=MemoryRanks(calls, available, used),
                options=HandoffOptions(swap="auto", prepare=False))
    assert h.swap is None  # auto: picked when the handoff starts
    h.begin()
    assert h.swap == swap and ("park_reserve" in calls) == pinned
    assert h.forecast.round_trip_estimate is not None


@pytest.mark.parametrize("mode, parks, locks_only", [
    ("checkpoint", False, False), ("park", True, True), ("park+checkpoint", True, False), ("resident", False, True),
])
def test_a_swap_mode_is_one_type_that_says_what_it_does_and_compares_as_its_name(mode, parks, locks_only):
    from timeslice_verl.names import SWAP_MODES, SwapMode

    m = SwapMode(mode)
    assert (m.parks, m.locks_only) == (parks, locks_only)
    assert m == mode and str(m) == f"{m}" == mode and json.dumps({"swap": m}) == json.dumps({"swap": mode})
    assert mode in SWAP_MODES


def shared(live_gib: float, used_gib: float, others_gib: float, available_gib: float = 128) -> dict:
    """A rank whose GPU also holds the job's rollouter and its vLLM (``device_others``): they stay, never frozen."""
    return {**rank("n1", live_gib, available_gib, used_gib), "device_others": int(others_gib * GiB)}


OTHERS = "of the job's other processes, which stay"


@pytest.mark.parametrize(
    ("reports", "swap", "why"),
    [
        # 19 GiB of trainer and 30 of rollouter stay beside a 50 GiB tenant on an H200 (room 84)
        ([shared(18, 19, 30)], "resident", f"resident fits: pid 7 keeps 19.0 GiB (+ 30.0 GiB {OTHERS}), room 84.0 GiB "
                                           "beside a 50.0 GiB tenant"),
        # 40 GiB fits alone, not with the rollouter's 50: park, which leaves 1 GiB of context beside the 50
        ([shared(39, 40, 50)], "park", f"resident does not fit: pid 7 keeps 40.0 GiB (+ 50.0 GiB {OTHERS}), room 84.0 "
                                       "GiB beside a 50.0 GiB tenant; park: n1 pins 39.0 GiB of 128.0 GiB available"),
        # what a parked rank keeps (9 GiB) plus the rollouter's 80 leave the tenant no room: checkpoint
        ([shared(10, 19, 80)], "checkpoint",
         f"resident does not fit: pid 7 keeps 19.0 GiB (+ 80.0 GiB {OTHERS}), room 84.0 GiB beside a 50.0 GiB tenant; "
         f"park leaves the tenant no room: pid 7 keeps 9.0 GiB parked (+ 80.0 GiB {OTHERS}), room 84.0 GiB beside a "
         "50.0 GiB tenant"),
        # the rollouter alone leaves no room: checkpoint, and the reason says lending wakes nothing
        ([shared(18, 19, 90)], "checkpoint",
         f"resident does not fit: pid 7 keeps 19.0 GiB (+ 90.0 GiB {OTHERS}), room 84.0 GiB beside a 50.0 GiB tenant; "
         f"park leaves the tenant no room: pid 7 keeps 1.0 GiB parked (+ 90.0 GiB {OTHERS}), room 84.0 GiB beside a "
         "50.0 GiB tenant; even a checkpoint leaves the tenant no room (pid 7's GPU: 90.0 GiB of the job's other "
         "processes, room 84.0 GiB beside a 50.0 GiB tenant): lower the rollout's gpu_memory_utilization or the "
         "tenant's"),
        # the rollouter on other GPUs (nothing of the job beside the rank): as before
        ([shared(39, 40, 0)], "resident", "resident fits: pid 7 keeps 40.0 GiB, room 84.0 GiB beside a 50.0 GiB tenant"),
    ],
)
def test_the_jobs_other_processes_on_the_gpu_count_as_staying(reports, swap, why):
    assert choose(reports, TENANT_50) == (swap, why)


def test_the_jobs_other_processes_are_told_by_their_tag():
    from timeslice_verl.ranks.worker import job_others

    tags = {1: "job-a", 2: "job-a", 3: None, 4: "job-b"}  # me, the rollouter's vLLM, the tenant, another job
    usage = [(1, 10 * GiB), (2, 30 * GiB), (3, 50 * GiB), (4, 7 * GiB), (5, GiB)]  # 5: gone meanwhile
    assert job_others(usage, 1, "job-a", tags.get) == 30 * GiB
    assert job_others(usage, 1, None, tags.get) == 0  # an untagged rank cannot tell its job's processes


def test_a_processs_tag_is_read_from_its_environment(procs):
    from agent_support import spawn_worker
    from timeslice_verl.ranks.worker import job_tag

    tagged, untagged = spawn_worker("rollout-job"), spawn_worker(None)
    procs.extend([tagged, untagged])
    assert job_tag(tagged.pid) == "rollout-job"
    assert job_tag(untagged.pid) is None
    assert job_tag(2**22 + 1) is None  # no such process
