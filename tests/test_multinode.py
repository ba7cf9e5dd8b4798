"""Multi-node SPMD time-slicing on one machine: two agents stand for two nodes (CPU test backend), one
rank per "node", each the client of its own node's agent, agreeing over gloo
(:class:`timeslice_verl.handoff.spmd.RankHandoff`).

Each node has a tagged stand-in GPU process (stopped by its agent's freeze, continued by its thaw)
and a stand-in vLLM tenant.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("torch")

from agent_support import AgentProc, FakeVllmProc, eventually, spawn_worker, stopped  # noqa: E402

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(tmp_path: Path, procs: list, *, slow_tenant_b: bool = False) -> list[dict]:
    nodes = []
    for name in ("a", "b"):
        slow = slow_tenant_b and name == "b"
        vllm = FakeVllmProc(*(["--token-s", "0.02"] if slow else []))
        (tmp_path / name).mkdir()
        # the slow node's agent lets requests in flight finish before its tenant sleeps (pause mode wait)
        agent = AgentProc(tmp_path / name, tenant_url=vllm.url, extra=("timeslice.tenant.pause_mode=wait",) if slow else ()).start()
        worker = spawn_worker(f"mn-{name}")  # the node's GPU process: each node's job has its own name here
        procs.extend([vllm, agent, worker])
        nodes.append({"name": name, "vllm": vllm, "agent": agent, "worker": worker, "job": f"mn-{name}"})
    return nodes


def _ranks(tmp_path: Path, nodes: list[dict], cycles: int, valley: float) -> tuple[list[subprocess.Popen], Path]:
    out = tmp_path / "ranks.jsonl"
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "TIMESLICE_JOB"}
    ranks = [
        subprocess.Popen([sys.executable, str(HERE / "spmd_rank.py"), str(i), "2", port, n["name"], n["job"],
                          str(n["agent"].socket), str(out), str(cycles), str(valley)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i, n in enumerate(nodes)
    ]
    return ranks, out


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _keep_busy(url: str, stop: threading.Event) -> None:
    """Long requests in flight on a tenant: its yield (pause mode wait) takes until they finish."""
    import httpx

    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            try:
                client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 60})
            except httpx.HTTPError:
                pass


def test_a_handoff_completes_on_every_rank_only_when_every_nodes_agent_did_its_part(tmp_path, procs):
    nodes = _nodes(tmp_path, procs, slow_tenant_b=True)
    stop = threading.Event()
    busy = threading.Thread(target=_keep_busy, args=(nodes[1]["vllm"].url, stop), daemon=True)
    ranks, out = _ranks(tmp_path, nodes, cycles=3, valley=0.8)
    procs.extend(ranks)
    busy.start()
    try:
        outputs = [r.communicate(timeout=120)[0] for r in ranks]
    finally:
        stop.set()
    assert [r.returncode for r in ranks] == [0, 0], outputs
    recs = _records(out)
    acquired = {(r["rank"], r["cycle"]): r for r in recs if r["event"] == "acquired"}
    for cycle in range(3):
        a, b = acquired[(0, cycle)], acquired[(1, cycle)]
        # node b's agent had to wait for its busy tenant; rank 0 (node a) was not done before it
        assert a["t"] >= b["agent_done"], f"cycle {cycle}: rank 0 went on before node b's agent granted"
    slow = [acquired[(1, c)]["agent_done"] - acquired[(1, c)]["t_start"] for c in range(3)]
    fast = [acquired[(0, c)]["agent_done"] - acquired[(0, c)]["t_start"] for c in range(3)]
    assert max(slow) > max(fast) + 0.3, (slow, fast)  # the test really had one slow node
    for n in nodes:  # both nodes' tenants froze the job's process during the valleys and serve again now
        transitions = n["agent"].status()["transitions"]
        assert transitions >= 3 * 4, transitions
        eventually(lambda n=n: n["agent"].job(n["job"]) is None and not n["vllm"].sleeping(), timeout=15,
                   what=f"node {n['name']}: job over, tenant serving")
        assert not stopped(n["worker"].pid)


def test_a_rank_lost_on_one_node_gives_the_other_nodes_gpus_back(tmp_path, procs):
    nodes = _nodes(tmp_path, procs)
    ranks, out = _ranks(tmp_path, nodes, cycles=50, valley=1.0)
    procs.extend(ranks)
    # wait until both nodes released once: each node's worker is frozen and its tenant serves
    eventually(lambda: sum(r["event"] == "released" for r in _records(out)) >= 2, timeout=60, what="first release")
    for n in nodes:
        eventually(lambda n=n: stopped(n["worker"].pid), timeout=10, what=f"node {n['name']} frozen")
    # node a loses its rank (the process and its GPU work die together)
    ranks[0].send_signal(signal.SIGKILL)
    os.kill(nodes[0]["worker"].pid, signal.SIGCONT)
    nodes[0]["worker"].kill()
    output = ranks[1].communicate(timeout=90)[0]
    assert ranks[1].returncode == 3 and "RankLost" in output and "a rank was lost" in output, output
    b = nodes[1]
    # node b: the job is over, its process runs again, its tenant has the GPU
    eventually(lambda: b["agent"].job(b["job"]) is None, timeout=15, what="node b forgot the job")
    assert not stopped(b["worker"].pid) and not b["vllm"].sleeping()
    a = nodes[0]
    eventually(lambda: not a["vllm"].sleeping(), timeout=15, what="node a's tenant serves")


def test_a_rank_handoff_built_from_settings_honours_every_handoff_setting():
    """SPMD trainers get the handoff section as verl's do: break-even, the way back and its lead (they dropped
    ``break_even_margin`` and forced ``prepare`` off before)."""
    from timeslice_verl.config.overrides import compose
    from timeslice_verl.handoff.spmd import RankHandoff

    settings = compose("interleave", ["timeslice.handoff.break_even_margin=3", "timeslice.handoff.prepare=true",
                                      "timeslice.handoff.prepare_lead_s=0.4", "timeslice.handoff.swap=park",
                                      "timeslice.handoff.late_cost=2", "timeslice.tenant.url="])
    rh = RankHandoff.from_settings(settings)
    o = rh.handoff.options
    assert (o.break_even_margin, o.prepare, o.prepare_lead_s, o.late_cost, o.swap) == (3.0, True, 0.4, 2.0, "park")
    f = rh.handoff.forecast
    assert (f.margin, f.lead_s, f.late_cost) == (3.0, 0.4, 2.0)
    f.observe_round_trip(1.0)
    f.observe_valley(2.0)  # SPMD without a backlog: valleys of 2 s against 3 round trips of 1 s
    assert not f.decide(None).release
    rh.lifecycle.stop()


def test_rank_handoff_names_bad_arguments_and_finds_the_agents_default_socket(tmp_path, monkeypatch):
    from timeslice_verl.handoff.spmd import RankHandoff

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert RankHandoff("j").socket_path == str(tmp_path / "timeslice-verl" / "agent.sock")
    with pytest.raises(ValueError, match="timeslice.handoff.swap: 'fast' is not one of checkpoint, park"):
        RankHandoff("j", swap="fast")
    with pytest.raises(ValueError, match="job 'my run' is not a job name"):
        RankHandoff("my run")
