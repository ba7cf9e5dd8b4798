"""Regressions found by running verl 0.9.1's fully-async trainer on H200s, reproduced on CPU.

* a process whose NCCL may hold peer-to-peer mappings is never checkpointed (its restore fails with
  error 304 and leaves it checkpointed for good): the freeze is refused, nothing is touched;
* a process the driver does not report as running is never touched (the freeze is refused);
* a refused freeze leaves the job on the GPU and the tenant asleep, and is retried next valley;
* a job that ended is forgotten, never frozen while its workers exit;
* the release waits for the step's model save (no freeze + restore per save);
* verl features that use the trainer's GPUs while it is released fail before launch;
* verl's workers get a registered method that frees their caches before a freeze.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent_support import eventually, spawn_worker, stopped
from test_agent_plugin import lifecycle_for, setup  # noqa: F401 (fixture)
from test_freeze_backend import ScriptedPrimitives
from timeslice_verl.agent import procfs
from timeslice_verl.agent.freeze.base import FreezeError, ProcState, FreezeBackend



def _maps_a_fake_nccl(tmp_path: Path, procs: list, env_extra: dict[str, str]) -> subprocess.Popen:
    """A process that maps a file named like NCCL's library, as a torch/cupy process does."""
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"\0" * mmap.PAGESIZE)
    code = (
        "import mmap, sys, time\n"
        f"f = open({str(lib)!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
        "print('mapped', flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NCCL_P2P_DISABLE"} | env_extra
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "mapped"
    return proc


class CudaScripted(ScriptedPrimitives):
    checkpoints_cuda = True


def test_a_process_with_nccl_p2p_on_is_refused_before_anything_is_touched(tmp_path, procs):
    proc = _maps_a_fake_nccl(tmp_path, procs, {})
    hazard = procfs.nccl_p2p_hazard(proc.pid)
    assert hazard and "NCCL_P2P_DISABLE=1" in hazard and "304" in hazard
    prims = CudaScripted()
    backend = FreezeBackend(prims, probe=None, driver_timeout_s=5)
    with pytest.raises(FreezeError, match="NCCL_P2P_DISABLE") as info:
        backend.freeze([proc.pid])
    assert info.value.refused and prims.calls == [], "a refused freeze touches nothing"


def test_the_same_process_with_p2p_off_is_frozen(tmp_path, procs):
    proc = _maps_a_fake_nccl(tmp_path, procs, {"NCCL_P2P_DISABLE": "1"})
    assert procfs.nccl_p2p_hazard(proc.pid) is None
    prims = CudaScripted()
    FreezeBackend(prims, probe=None, driver_timeout_s=5).freeze([proc.pid])
    assert prims.calls == [("lock", proc.pid), ("checkpoint", proc.pid)]


def test_a_backend_that_moves_no_cuda_state_ignores_nccl(tmp_path, procs):
    proc = _maps_a_fake_nccl(tmp_path, procs, {})
    prims = ScriptedPrimitives()  # no checkpoints_cuda: e.g. the sigstop test backend
    FreezeBackend(prims, probe=None, driver_timeout_s=5).freeze([proc.pid])
    assert ("checkpoint", proc.pid) in prims.calls


@pytest.mark.parametrize("state", [ProcState.LOCKED, ProcState.CHECKPOINTED, ProcState.FAILED])
def test_a_process_not_reported_running_is_refused(state):
    prims = ScriptedPrimitives()
    prims.state_of[os.getpid()] = state
    with pytest.raises(FreezeError, match="only running processes are frozen") as info:
        FreezeBackend(prims, probe=None, driver_timeout_s=5).freeze([os.getpid()])
    assert info.value.refused and prims.calls == []




def test_a_refused_freeze_keeps_the_job_on_the_gpu_and_the_tenant_asleep(agent, vllm, procs):
    w = spawn_worker("job-r")
    procs.append(w)
    with agent.client() as c:
        c.acquire("job-r")
        os.kill(w.pid, signal.SIGSTOP)  # someone else stopped it: the sigstop driver reports "checkpointed"
        eventually(lambda: stopped(w.pid))
        c.release("job-r", wait=True)
        job = agent.job("job-r")
        assert job["state"] == "RUNNING" and "refusing to freeze" in job["refused"]
        assert vllm.sleeping(), "the tenant never wakes under a job that could not be frozen"
        assert agent.status()["transitions"] >= 1
        os.kill(w.pid, signal.SIGCONT)
        eventually(lambda: not stopped(w.pid))
        # the next valley tries again, and this time it works
        c.acquire("job-r")
        c.release("job-r", wait=True)
        eventually(lambda: stopped(w.pid) and not vllm.sleeping(), what="frozen on the next release")
        assert agent.job("job-r")["refused"] == ""


def test_a_job_that_ended_is_forgotten_not_frozen(agent, vllm, procs):
    w = spawn_worker("job-d")
    procs.append(w)
    with agent.client() as c:
        c.acquire("job-d")
        c.release("job-d", wait=True, done=True)
    eventually(lambda: agent.job("job-d") is None and not vllm.sleeping(), what="forgotten, tenant awake")
    assert not stopped(w.pid)


def test_a_job_that_ends_while_frozen_is_thawed_then_forgotten(agent, vllm, procs):
    w = spawn_worker("job-e")
    procs.append(w)
    with agent.client() as c:
        c.acquire("job-e")
        c.release("job-e", wait=True)
        eventually(lambda: stopped(w.pid))
        c.release("job-e", wait=True, done=True)
    eventually(lambda: agent.job("job-e") is None, what="forgotten")
    assert not stopped(w.pid), "an ended job is never left frozen"
    assert not vllm.sleeping()


# --------------------------------------------------------------------------- trainer side

needs_verl = pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="needs verl installed (pip install '.[verl]')")


class FakeWorkers:
    """``lifecycle.ranks`` as the verl adapter provides it; checks it is asked while the job still runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.calls: list[bool] = []

    def local_pids(self) -> list[int]:
        return [self.pid]

    def release_caches(self) -> list[dict]:
        self.calls.append(stopped(self.pid))
        return [{"pid": self.pid, "live_before": 4 << 30, "live_after": 4 << 30, "reserved_before": 7 << 30, "reserved_after": 5 << 30}]


def test_the_plugin_has_workers_free_their_caches_before_each_release(setup):
    from timeslice_verl.testing import RecordingPlugin, fake_event_sequence, play

    tmp_path, agent, vllm, worker = setup
    recorder = RecordingPlugin()
    lc = lifecycle_for(tmp_path, agent, recorder)
    lc.ranks = FakeWorkers(worker.pid)
    play(lc, fake_event_sequence(2))
    releases = [e for e in recorder.events("handoff") if e.action == "release"]
    freeing = [e for e in releases if e.point != "timeslice_stop"]
    assert lc.ranks.calls and not any(lc.ranks.calls), "caches are freed before the freeze, never after"
    assert len(lc.ranks.calls) == len(freeing) + 1, "and once when the model is loaded (what the round trip will cost)"
    assert all(e.live_bytes == 4 << 30 and e.reserved_before == 7 << 30 and e.reserved_after == 5 << 30 for e in freeing)



@needs_verl
def test_release_waits_for_the_steps_save():
    from types import SimpleNamespace

    from timeslice_verl.adapters.common import save_due

    def trainer(version, freq, last=0):
        return SimpleNamespace(config=SimpleNamespace(trainer=SimpleNamespace(save_freq=freq)), current_param_version=version,
                               last_ckpt_version=last)

    table = [((4, 2), True), ((3, 2), False), ((4, -1), False), ((4, 0), False), ((4, 2, 4), False)]
    for args, due in table:
        assert save_due(trainer(*args)) is due, args


@needs_verl
def test_gpu_use_while_released_fails_before_launch():
    from omegaconf import OmegaConf

    from timeslice_verl.adapters.preflight import preflight
    from timeslice_verl.config.schema import ConfigError

    for key in ("use_trainer_do_validate", "use_dynamic_resource_scheduling"):
        cfg = OmegaConf.create({"timeslice": {"enabled": True}, "async_training": {key: True}})
        with pytest.raises(ConfigError, match=f"async_training.{key}"):
            preflight(cfg)
        observe = OmegaConf.create({"timeslice": {"plugins": {"disabled": ["agent"]}}, "async_training": {key: True}})
        preflight(observe)  # observe-only never hands the GPU over
    preflight(OmegaConf.create({"async_training": {"use_trainer_do_validate": True}}))  # no timeslice: inert


@needs_verl
def test_run_ppo_is_wrapped_by_the_preflight():
    import verl.trainer.main_ppo as main_ppo
    from omegaconf import OmegaConf

    assert getattr(main_ppo.run_ppo, "__timeslice_preflight__", False)
    cfg = OmegaConf.create({"timeslice": {"enabled": True}, "async_training": {"use_trainer_do_validate": True}})
    # refused before verl starts Ray, as an exit with the reason (Python and Hydra print no traceback for it)
    with pytest.raises(SystemExit) as refused:
        main_ppo.run_ppo(cfg, task_runner_class=None)
    assert not isinstance(refused.value, Exception)
    assert str(refused.value.code).startswith("timeslice refused this config before starting verl: "
                                              "async_training.use_trainer_do_validate: is true")


@needs_verl
def test_verl_workers_get_the_release_caches_and_park_methods_on_every_rank():
    from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch
    from verl.single_controller.base.worker import Worker
    from verl.single_controller.ray.base import _bind_workers_method_to_parent

    from timeslice_verl.ranks.worker import PARK, PARK_RESERVE, RELEASE_CACHES, UNPARK, release_caches_here

    for name in (RELEASE_CACHES, PARK_RESERVE, PARK, UNPARK):
        assert getattr(getattr(Worker, name), MAGIC_ATTR)["dispatch_mode"] == Dispatch.ONE_TO_ALL, name

    class Colocated:  # what create_colocated_worker_cls builds: role-prefixed copies of registered methods
        pass

    class ActorWorker(Worker):
        pass

    _bind_workers_method_to_parent(Colocated, "actor", ActorWorker)
    assert all(hasattr(Colocated, f"actor_{name}") for name in (RELEASE_CACHES, PARK_RESERVE, PARK, UNPARK))
    report = release_caches_here()
    assert report["pid"] == os.getpid() and "live_before" not in report  # no CUDA here: nothing to free
