"""verl across nodes on CPU: a local two-node Ray cluster, an agent per node, verl's real worker group.

Each Ray node gets its own ``XDG_RUNTIME_DIR`` (so its own default agent socket) and its own agent (CPU test
backend) with a stand-in vLLM; verl's ``RayWorkerGroup`` places one worker on each node; the handoff's agent
client is :class:`~timeslice_verl.handoff.nodes.NodeAgents`, one actor per node.
"""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = [
    pytest.mark.verl,
    pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl test: verl is not installed"),
]

from agent_support import AgentProc, FakeVllmProc, eventually, stopped  # noqa: E402
from timeslice_verl.handoff.options import HandoffOptions  # noqa: E402
from timeslice_verl.handoff.ranks import RankLost  # noqa: E402
from timeslice_verl.handoff.sequence import Handoff  # noqa: E402

JOB = "mn-verl"


def _node(tmp_path: Path, name: str, procs: list) -> dict:
    """An agent (a short re-attach grace: a job whose client is gone is thawed soon) and a stand-in vLLM."""
    xdg = tmp_path / f"xdg-{name}"
    (xdg / "timeslice-verl").mkdir(parents=True, mode=0o700)
    os.chmod(xdg, 0o700)
    vllm = FakeVllmProc()
    procs.append(vllm)
    (tmp_path / name).mkdir()
    agent = AgentProc(tmp_path / name, tenant_url=vllm.url, extra=("timeslice.agent.reattach_grace_s=1",))
    agent.socket = xdg / "timeslice-verl" / "agent.sock"  # the node's default socket
    agent.start()
    procs.append(agent)
    return {"xdg": xdg, "vllm": vllm, "agent": agent}


@pytest.fixture
def cluster(tmp_path, procs, monkeypatch):
    import ray
    from ray.cluster_utils import Cluster

    # on a loaded 2-core machine a new Ray worker takes longer than production's bound to answer its first call
    monkeypatch.setattr("timeslice_verl.adapters.workers.WHOAMI_TIMEOUT_S", 300.0)

    nodes = {name: _node(tmp_path, name, procs) for name in ("a", "b")}
    # logical CPUs: verl's placement-group bundles ask for several per worker, whatever the machine has
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 16, "env_vars": {"XDG_RUNTIME_DIR": str(nodes["a"]["xdg"])}})
    nodes["b"]["ray"] = c.add_node(num_cpus=16, env_vars={"XDG_RUNTIME_DIR": str(nodes["b"]["xdg"])})
    nodes["cluster"] = c
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield nodes
    finally:
        ray.shutdown()
        c.shutdown()


def _worker_group():
    import ray
    from verl.single_controller.base.worker import Worker
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    import timeslice_verl.adapters.workers  # noqa: F401  (gives verl's Worker the timeslice methods)

    pool = RayResourcePool(process_on_nodes=[1, 1], use_gpu=False)
    return RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(Worker)))


def _handoff() -> tuple[Handoff, dict[str, list[int]], object]:
    """verl's worker group over both nodes and the handoff the agent plugin builds for it, past model loading."""
    from timeslice_verl.adapters.workers import VerlRanks
    from timeslice_verl.handoff.nodes import NodeAgents

    ranks = VerlRanks(SimpleNamespace(actor_rollout_wg=_worker_group()))
    by_node = ranks.node_pids()
    assert len(by_node) == 2 and all(len(p) == 1 for p in by_node.values()), by_node
    agents = NodeAgents.on_ray_nodes(client_name=f"trainer:{JOB}", connect_timeout_s=5.0)  # as the agent plugin does
    assert sorted(agents.actors) == sorted(by_node), "every node's agent answers"
    handoff = Handoff(JOB, client=agents, ranks=ranks, options=HandoffOptions(swap="checkpoint", prepare=False,
                                                                       break_even_margin=0))  # scripted: lend all
    handoff.held = False
    handoff.acquire("init_workers_begin")  # model loading: every node's GPUs
    handoff.begin()  # each node's agent learns its own worker's pid
    return handoff, by_node, agents


def _node_a_gave_back(cluster: dict, pid_a: int) -> None:
    a = cluster["a"]
    eventually(lambda: a["agent"].job(JOB) is None, what="node a's agent forgot the job")
    eventually(lambda: not stopped(pid_a), what="node a's rank thawed")
    eventually(lambda: not a["vllm"].sleeping(), what="node a's tenant has its GPU back")


def test_every_nodes_ranks_are_frozen_in_every_valley_and_a_lost_node_gives_the_others_back(cluster):
    handoff, by_node, agents = _handoff()
    pids = [p for ps in by_node.values() for p in ps]
    tenants = [cluster[n]["vllm"] for n in ("a", "b")]
    for cycle in range(3):
        handoff.release("weight_sync_end")
        eventually(lambda: all(stopped(p) for p in pids), what=f"cycle {cycle}: every node's rank frozen")
        eventually(lambda: not any(v.sleeping() for v in tenants), what=f"cycle {cycle}: every node's tenant awake")
        out = handoff.acquire("pre_train_step")
        assert not any(stopped(p) for p in pids), f"cycle {cycle}: a rank still frozen in the step"
        assert all(v.sleeping() for v in tenants)
        assert len(out.agent["nodes"]) == 2
    # node b's agent is lost during a valley: the acquire fails, node a gives its GPU back
    handoff.release("weight_sync_end")
    eventually(lambda: all(stopped(p) for p in pids), what="frozen before the loss")
    cluster["b"]["agent"].kill()
    with pytest.raises(RankLost, match="failed on 1 of 2 node"):
        handoff.acquire("pre_train_step")
    import ray

    _node_a_gave_back(cluster, by_node[ray.get_runtime_context().get_node_id()][0])  # the driver runs on node a
    for pid in pids:  # node b's rank stays as its killed agent left it (a restarted agent would thaw it)
        os.kill(pid, signal.SIGCONT)
    agents.close()


def test_a_ray_node_that_dies_in_a_valley_leaves_no_gpu_held_on_either_node(cluster):
    """Node b itself goes (its raylet and every Ray process on it: the rank, the agent's actor), not only its
    agent: the acquire fails, node a gives its GPU back, and node b's agent, whose client is gone, thaws what
    is left of the rank and keeps its tenant awake."""
    import ray

    handoff, by_node, agents = _handoff()
    node_a = ray.get_runtime_context().get_node_id()
    pid_a = by_node[node_a][0]
    pid_b = next(ps[0] for node, ps in by_node.items() if node != node_a)
    handoff.release("weight_sync_end")
    eventually(lambda: stopped(pid_a) and stopped(pid_b), what="both ranks frozen in the valley")
    node_b = cluster["b"]["ray"].node_id
    cluster["cluster"].remove_node(cluster["b"]["ray"], allow_graceful=False)
    eventually(lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node_b), what="Ray saw node b die", timeout=120, interval=0.5)
    with pytest.raises(RankLost, match="failed on 1 of 2 node"):
        handoff.acquire("pre_train_step")
    _node_a_gave_back(cluster, pid_a)
    b = cluster["b"]
    eventually(lambda: (b["agent"].job(JOB) or {}).get("state") != "frozen", what="node b's agent thawed the orphaned job")
    eventually(lambda: not stopped(pid_b), what="node b's rank is not left stopped")
    assert not b["vllm"].sleeping(), "node b's tenant keeps the GPU"
    agents.close()
