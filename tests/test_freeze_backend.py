"""Freeze/thaw sequencing: lock all then checkpoint all, restore all then unlock all, unwinding."""

from __future__ import annotations

import atexit
import subprocess
import sys
import threading

import pytest

from timeslice_verl.agent.freeze.base import DriverTimeout, FreezeError, ProcState, ThawError, FreezeBackend


class ScriptedPrimitives:
    """Per-process primitives that record calls and fail where told."""

    name = "scripted"
    frees_gpu_memory = True
    description = "test double"

    def __init__(self, fail: dict[tuple[str, int], Exception] | None = None, hang: tuple[str, int] | None = None):
        self.calls: list[tuple[str, int]] = []
        self.state_of: dict[int, ProcState] = {}
        self.fail = fail or {}
        self.hang = hang
        self.release = threading.Event()

    def _op(self, op: str, pid: int, new: ProcState) -> None:
        self.calls.append((op, pid))
        if (op, pid) == self.hang:
            self.release.wait(5)
        if (op, pid) in self.fail:
            raise self.fail[(op, pid)]
        self.state_of[pid] = new

    def lock(self, pid, timeout_s):
        self._op("lock", pid, ProcState.LOCKED)

    def checkpoint(self, pid):
        self._op("checkpoint", pid, ProcState.CHECKPOINTED)

    def restore(self, pid):
        self._op("restore", pid, ProcState.LOCKED)

    def unlock(self, pid):
        self._op("unlock", pid, ProcState.RUNNING)

    def state(self, pid):
        return self.state_of.get(pid, ProcState.RUNNING)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])


# three real, live, distinct processes of our own, so `states()` sees them as present (the test
# process, its parent and PID 1 are not distinct when pytest runs as PID 1 in a container)
_SLEEPERS = [_sleeper() for _ in range(3)]
atexit.register(lambda: [p.kill() for p in _SLEEPERS])
P1, P2, P3 = (p.pid for p in _SLEEPERS)


def backend(prims, timeout=5.0):
    return FreezeBackend(prims, probe=None, driver_timeout_s=timeout)


def test_freeze_locks_all_before_checkpointing_any_and_thaw_restores_all_before_unlocking():
    prims = ScriptedPrimitives()
    b = backend(prims)
    b.freeze([P1, P2, P3])
    assert prims.calls[:3] == [("lock", P1), ("lock", P2), ("lock", P3)]
    assert sorted(prims.calls[3:]) == sorted([("checkpoint", P1), ("checkpoint", P2), ("checkpoint", P3)])
    prims.calls.clear()
    report = b.thaw([P1, P2, P3])
    assert sorted(prims.calls[:3]) == sorted([("restore", P1), ("restore", P2), ("restore", P3)])
    assert prims.calls[3:] == [("unlock", P1), ("unlock", P2), ("unlock", P3)]
    assert report.restored == [P1, P2, P3]
    assert all(s == ProcState.RUNNING for s in prims.state_of.values())


def test_failed_lock_unlocks_what_was_locked():
    prims = ScriptedPrimitives(fail={("lock", P2): RuntimeError("CUDA_ERROR_NOT_READY")})
    with pytest.raises(FreezeError) as err:
        backend(prims).freeze([P1, P2, P3])
    assert err.value.unwound and "CUDA_ERROR_NOT_READY" in str(err.value)
    assert prims.calls == [("lock", P1), ("lock", P2), ("unlock", P1)]
    assert prims.state_of[P1] == ProcState.RUNNING


def test_failed_checkpoint_restores_and_unlocks_everything():
    prims = ScriptedPrimitives(fail={("checkpoint", P3): RuntimeError("out of host memory")})
    with pytest.raises(FreezeError) as err:
        backend(prims).freeze([P1, P2, P3])
    assert err.value.unwound
    assert prims.calls[6:] == [("restore", P2), ("restore", P1), ("unlock", P3), ("unlock", P2), ("unlock", P1)]
    assert all(prims.state_of[p] == ProcState.RUNNING for p in (P1, P2))


def test_failed_unwind_is_reported_as_inconsistent():
    prims = ScriptedPrimitives(fail={("checkpoint", P2): RuntimeError("boom"), ("restore", P1): RuntimeError("stuck")})
    with pytest.raises(FreezeError) as err:
        backend(prims).freeze([P1, P2])
    assert not err.value.unwound and "unwinding failed too" in str(err.value) and "stuck" in str(err.value)


def test_failed_restore_re_checkpoints_the_restored_ones():
    prims = ScriptedPrimitives()
    b = backend(prims)
    b.freeze([P1, P2])
    prims.fail = {("restore", P2): RuntimeError("CUDA_ERROR_OUT_OF_MEMORY")}
    prims.calls.clear()
    with pytest.raises(ThawError) as err:
        b.thaw([P1, P2])
    assert err.value.still_frozen and "OUT_OF_MEMORY" in str(err.value)
    assert sorted(prims.calls[:2]) == sorted([("restore", P1), ("restore", P2)])
    assert prims.calls[2:] == [("checkpoint", P1)]
    assert prims.state_of[P1] == ProcState.CHECKPOINTED


class MeetingPrimitives(ScriptedPrimitives):
    """Each checkpoint and restore waits until all of the job's are under way: only calls made side by
    side get through (one after the other, the first waits alone and fails)."""

    def __init__(self, n: int):
        super().__init__()
        self.meet = threading.Barrier(n, timeout=2)

    def checkpoint(self, pid):
        self.meet.wait()
        super().checkpoint(pid)

    def restore(self, pid):
        self.meet.wait()
        super().restore(pid)


def test_checkpoints_and_restores_of_a_jobs_processes_run_side_by_side():
    prims = MeetingPrimitives(3)
    b = backend(prims)
    b.freeze([P1, P2, P3])
    assert all(prims.state_of[p] == ProcState.CHECKPOINTED for p in (P1, P2, P3))
    assert b.thaw([P1, P2, P3]).restored == [P1, P2, P3]
    assert all(prims.state_of[p] == ProcState.RUNNING for p in (P1, P2, P3))


def test_a_hung_checkpoint_beside_finished_ones_unwinds_those_and_names_the_hung_pid():
    prims = ScriptedPrimitives(hang=("checkpoint", P2))
    with pytest.raises(FreezeError) as err:
        backend(prims, timeout=0.3).freeze([P1, P2, P3])
    prims.release.set()
    assert f"checkpoint of pid {P2} did not return within 0.3 s" in str(err.value) and err.value.unwound
    assert ("restore", P1) in prims.calls and ("restore", P3) in prims.calls and ("restore", P2) not in prims.calls


def test_every_driver_call_has_a_timeout():
    prims = ScriptedPrimitives(hang=("checkpoint", P1))
    with pytest.raises(FreezeError) as err:
        backend(prims, timeout=0.2).freeze([P1])
    prims.release.set()
    assert "did not return within 0.2 s" in str(err.value)
    assert isinstance(err.value.__cause__, DriverTimeout)


def test_thaw_skips_processes_that_are_gone_or_running():
    prims = ScriptedPrimitives()
    b = backend(prims)
    b.freeze([P1])
    report = b.thaw([P1, 2**22 + 12345])  # a pid that does not exist
    assert report.restored == [P1]
    assert ("restore", 2**22 + 12345) not in prims.calls
