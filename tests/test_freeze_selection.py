"""A freeze touches the trainer's ranks only: never verl's rollouter, its vLLM or the rollout side's
CheckpointEngineWorker, which carry the job's tag too and may share the trainer's GPU.

The table drives the pure choice; the daemon tests run real tagged processes titled as verl's are, the real
agent with its CPU backend (SIGSTOP) and a trainer rank registered the way the handoff registers it, and read
every process's state from ``/proc/<pid>/stat``.
"""

from __future__ import annotations

import subprocess
import uuid

import pytest

from agent_support import PY, AgentProc, _SPAWNED, eventually, proc_state, stopped
from timeslice_verl.agent.freeze.base import FreezeBackend
from timeslice_verl.agent.selection import Candidate, Left, rollout_title, select

RANK, ROLLOUTER, SERVER = "ray::WorkerDict", "ray::FullyAsyncRollouter", "ray::vLLMHttpServer.generate"
ENGINE, CKPT = "VLLM::EngineCore", "ray::CheckpointEngineWorker"


def C(pid: int, title: str = RANK, **kw) -> Candidate:
    return Candidate(pid, title=title, **kw)


@pytest.mark.parametrize(
    ("candidates", "frozen", "left"),
    [
        # one GPU for trainer and rollouter, the rank registered: the rank only
        ([C(1, registered=True), C(2, ROLLOUTER), C(3, SERVER), C(4, ENGINE), C(5, CKPT)], [1],
         {2: Left.NOT_A_RANK, 3: Left.NOT_A_RANK, 4: Left.NOT_A_RANK, 5: Left.NOT_A_RANK}),
        # registered ranks rule whatever a tagged process is called (an unknown helper of the job stays running)
        ([C(1, registered=True), C(2, RANK), C(3, "python helper.py")], [1], {2: Left.NOT_A_RANK, 3: Left.NOT_A_RANK}),
        # the rollouter on other GPUs (NVML places it elsewhere): nothing changes, the rank is frozen
        ([C(1, registered=True), C(2, ROLLOUTER, on_gpu=False), C(3, ENGINE, on_gpu=False)], [1],
         {2: Left.OFF_GPU, 3: Left.OFF_GPU}),
        # the job's ranks are all on other GPUs: the rollouter on this one is still not the trainer's
        ([C(1, registered=True, on_gpu=False), C(2, ENGINE)], [], {1: Left.OFF_GPU, 2: Left.NOT_A_RANK}),
        # no registration (SPMD by tag, or a registration that failed): the tag, minus the rollout side's titles
        ([C(1), C(2), C(3, ROLLOUTER), C(4, ENGINE), C(5, CKPT), C(6, "VLLM::Worker_TP0")], [1, 2],
         {3: Left.ROLLOUT, 4: Left.ROLLOUT, 5: Left.ROLLOUT, 6: Left.ROLLOUT}),
        # a client is never stopped, registered or not; another user's tagged process is not the job's
        ([C(1, registered=True, client=True), C(2, owner_ok=False), C(3, registered=True, tagged=False)], [3],
         {1: Left.CLIENT, 2: Left.OTHER_USER}),
        ([C(2, owner_ok=False), C(4)], [4], {2: Left.OTHER_USER}),
        # an SPMD rank registered itself and is a client the backend leaves running: its tag finds the GPU work
        ([C(1, registered=True, client=True), C(2), C(3, ENGINE)], [2], {1: Left.CLIENT, 3: Left.ROLLOUT}),
        ([], [], {}),
    ],
)
def test_only_the_trainer_ranks_are_frozen(candidates, frozen, left):
    chosen = select(candidates)
    assert list(chosen.freeze) == frozen
    assert {c.pid: why for c, why in chosen.left} == left


@pytest.mark.parametrize(
    ("title", "rollout"),
    [(RANK, False), ("ray::WorkerDict.actor_rollout_update_actor", False), (ROLLOUTER, True), (SERVER, True),
     ("ray::vLLMHttpServer", True), (ENGINE, True), ("VLLM::Worker_TP1", True), (CKPT, True),
     ("ray::CheckpointEngineWorkerX", False), ("ray::", False), ("", False), ("python -m vllm", False),
     ("ray::SGLangHttpServer.launch", True), ("ray::FullyAsyncTrainer.fit", False)],
)
def test_rollout_titles(title, rollout):
    assert rollout_title(title) is rollout


# --------------------------------------------------------------------------- real processes


def titled_worker(job: str, title: str) -> subprocess.Popen:
    """A busy process tagged ``TIMESLICE_JOB=<job>`` whose command line starts with ``title`` (what Ray's and vLLM's
    setproctitle leave there), returned once its tag is readable."""
    import os

    env = {**{k: v for k, v in os.environ.items() if k != "TIMESLICE_JOB"}, "TIMESLICE_JOB": job}
    proc = subprocess.Popen([title, "-c", "import time\nwhile True:\n    time.sleep(0.005)\n"], executable=PY, env=env)
    _SPAWNED.append(proc)

    def ready() -> bool:
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                return f"TIMESLICE_JOB={job}".encode() in f.read()
        except OSError:
            return False

    eventually(ready, what=f"{title} tagged")
    return proc


@pytest.fixture
def one_gpu_job(procs):
    """A unique job whose trainer rank and rollout side run side by side, as on one shared GPU."""
    job = f"shared-{uuid.uuid4().hex[:8]}"
    workers = {title: titled_worker(job, title) for title in (RANK, ROLLOUTER, SERVER, ENGINE, CKPT)}
    procs.extend(workers.values())
    return job, workers


def running(pid: int) -> bool:
    return proc_state(pid) not in ("T", "t", "Z", "X", "gone")


def test_a_registered_rank_is_frozen_and_the_rollout_side_runs_on(tmp_path, one_gpu_job, procs):
    job, workers = one_gpu_job
    rank, others = workers[RANK], [w for t, w in workers.items() if t != RANK]
    agent = AgentProc(tmp_path).start()
    procs.append(agent)
    with agent.client() as c:
        for cycle in range(2):
            c.acquire(job)
            if cycle == 0:
                c.register_pids(job, [rank.pid])  # what handoff.start.register_pids sends for the driver's ranks
            c.release(job, wait=True)
            assert stopped(rank.pid), "the trainer rank is frozen"
            assert all(running(w.pid) for w in others), {w.pid: proc_state(w.pid) for w in others}
            assert agent.job(job)["pids"] == [rank.pid]
            c.acquire(job)
            assert all(running(w.pid) for w in workers.values()), {w.pid: proc_state(w.pid) for w in workers.values()}
    log = agent.log()
    for w in others:  # each process left running is told once, with why
        assert log.count(f"pid {w.pid} (") == 1, log
    assert f"pid {workers[ENGINE].pid} ({ENGINE} -c" in log and str(Left.NOT_A_RANK) in log


def test_without_a_registration_the_rollout_side_is_still_never_frozen(tmp_path, one_gpu_job, procs):
    job, workers = one_gpu_job
    agent = AgentProc(tmp_path).start()
    procs.append(agent)
    with agent.client() as c:
        c.acquire(job)
        c.release(job, wait=True)
        assert stopped(workers[RANK].pid)
        assert all(running(w.pid) for t, w in workers.items() if t != RANK)
        c.acquire(job)
        assert all(running(w.pid) for w in workers.values())


class GpuView:
    """NVML as the agent would see it: ``placed`` pids on its GPU, a GiB each."""

    def __init__(self, placed: set[int]) -> None:
        self.placed = placed

    def process_memory(self) -> dict[int, int]:
        return {pid: 2**30 for pid in self.placed}

    def used_by(self, pids: list[int]) -> int:
        return sum(self.process_memory().get(p, 0) for p in pids)


@pytest.mark.parametrize("view", ["none", "one shared GPU", "rollouter on another GPU"])
def test_the_cpu_backend_freezes_and_thaws_the_rank_alone(one_gpu_job, view):
    """The freeze backend itself, without the daemon: discovery, SIGSTOP and SIGCONT on real processes, with no GPU
    view, with every process on the agent's one GPU, and with the rollout side on another GPU."""
    from timeslice_verl.agent.freeze.sigstop import SigstopPrimitives

    class GpuSigstop(SigstopPrimitives):
        frees_gpu_memory = True  # so the agent filters by its GPU view, as the CUDA backends do

    job, workers = one_gpu_job
    rank = workers[RANK].pid
    everyone = {w.pid for w in workers.values()}
    probe = {"none": None, "one shared GPU": GpuView(everyone), "rollouter on another GPU": GpuView({rank})}[view]
    backend = FreezeBackend(GpuSigstop() if probe else SigstopPrimitives(), probe=probe, driver_timeout_s=30)
    try:
        pids = backend.discover(job, [rank])
        assert pids == [rank]
        backend.freeze(pids)
        assert {t: stopped(w.pid) for t, w in workers.items()} == {t: t == RANK for t in workers}
        backend.thaw(pids)
        assert all(running(w.pid) for w in workers.values())
    finally:
        backend.close()
