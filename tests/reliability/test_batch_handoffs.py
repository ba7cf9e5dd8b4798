"""Batch work survives every handoff: a batch of 5 000 lines fed to a supervised tenant through 20+
handoffs of a real agent, with the four ways a line's request can be lost injected once each — the ladder's abort
step, the ladder's kill of a wedged tenant, a crash of the tenant, a ``kill -9`` of the batch service itself.

Every process is real: the agent daemon, ``timeslice-verl tenant run`` over the stand-in vLLM, ``timeslice-verl
batch serve`` with its SQLite file; the trainer is this test, holding and releasing the GPU through the agent's
socket. Valleys end on events (lines answered, a fault seen through), never on a clock.
"""

from __future__ import annotations

import collections
import json
import os
import signal

import httpx
import pytest

from agent_support import AgentProc, eventually, spawn_worker
from batch_support import BatchServiceProc, SupervisorProc, write_requests

pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")

LINES = 5000
PER_VALLEY = 100
"""Lines a plain valley lets through before the trainer takes the GPU back (≈ 50 handoffs for the batch, fewer
when the feeder overshoots: every fault is injected by handoff 15)."""
FAULTS = {3: "abort", 7: "ladder kill", 11: "tenant crash", 15: "service kill -9"}


def _counts(service: BatchServiceProc, bid: str) -> dict:
    try:
        return service.get(f"/v1/batches/{bid}")
    except httpx.HTTPError:  # killed and not back yet
        return {}


def _done(service: BatchServiceProc, bid: str) -> int:
    batch = _counts(service, bid)
    return batch["request_counts"]["completed"] + batch["request_counts"]["failed"] if batch else -1


def _tenant(agent: AgentProc) -> dict:
    return agent.status().get("tenant") or {}


def _inflight(service: BatchServiceProc) -> bool:
    try:
        return service.get("/timeslice/summary")["lines"]["inflight"] > 0
    except httpx.HTTPError:
        return False


def _valley(fault: str | None, agent: AgentProc, tenant: SupervisorProc, service: BatchServiceProc, bid: str) -> None:
    """The GPU is the tenant's: let lines through, and inject ``fault`` while requests are in flight."""
    before = max(_done(service, bid), 0)
    if fault is None:
        eventually(lambda: _done(service, bid) >= min(before + PER_VALLEY, LINES), timeout=120, what="a valley's lines")
        return
    eventually(lambda: _inflight(service), timeout=120, what="lines in flight")
    pid = _tenant(agent)["supervisor"]["pid"]
    if fault == "abort":  # the polite step cannot pause the server: the ladder's abort step fails what runs
        httpx.post(f"{tenant.url}/_standin/fault", json={"hang": "pause:keep"}, timeout=10).raise_for_status()
    elif fault == "ladder kill":  # the server stops answering while it has the GPU: the probe marks it wedged
        os.kill(pid, signal.SIGSTOP)
        eventually(lambda: _tenant(agent).get("wedged"), timeout=120, what="the tenant seen wedged")
    elif fault == "tenant crash":
        os.kill(pid, signal.SIGKILL)
        eventually(lambda: (_tenant(agent).get("supervisor") or {}).get("pid") not in (None, pid)
                   and _tenant(agent).get("state") == "awake", timeout=120, what="the tenant restarted and registered")
        eventually(lambda: _done(service, bid) > before, timeout=120, what="lines answered by the restarted tenant")
    else:
        service.kill()
        service.start()
        eventually(lambda: _done(service, bid) > before, timeout=120, what="lines answered after the service's restart")


def test_every_line_of_a_batch_is_answered_exactly_once_through_handoffs_and_faults(tmp_path, procs):
    worker = spawn_worker("job-a")
    procs.append(worker)
    agent_sock = tmp_path / "run" / "agent.sock"
    tenant = SupervisorProc(tmp_path, agent_sock, "--token-s", "0.004", "--max-num-seqs", "16")
    procs.append(tenant)
    agent = AgentProc(tmp_path, tenant_url=tenant.url, extra=(
        "timeslice.tenant.reclaim_deadline_s=4", "timeslice.tenant.probe_interval_s=0.2",
        "timeslice.tenant.probe_timeout_s=0.5")).start()
    procs.append(agent)
    eventually(lambda: _tenant(agent).get("supervisor") and _tenant(agent)["state"] == "awake", timeout=120,
               what="the supervised tenant registered")
    service = BatchServiceProc(tmp_path, tenant.url, agent_socket=agent.socket).start()
    procs.append(service)

    ids = write_requests(tmp_path / "in.jsonl", LINES, max_tokens=lambda i: 4 + i % 29)
    with agent.client() as trainer:
        trainer.acquire("job-a")  # the trainer computes first: nothing goes out until its first valley
        with service.http() as http:
            fid = http.post("/v1/files", files={"file": ("in.jsonl", (tmp_path / "in.jsonl").read_bytes())},
                            data={"purpose": "batch"}).json()["id"]
            bid = http.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                 "completion_window": "24h"}).json()["id"]
        assert _done(service, bid) == 0, "lines went out while the trainer held the GPU"
        handoffs = 0
        while _counts(service, bid).get("status") != "completed":
            handoffs += 1
            trainer.release("job-a", wait=True)
            _valley(FAULTS.get(handoffs), agent, tenant, service, bid)
            trainer.acquire("job-a", timeout_s=120)
            if FAULTS.get(handoffs) == "abort":
                httpx.post(f"{tenant.url}/_standin/fault", json={"hang": ""}, timeout=10).raise_for_status()
            assert handoffs < 200, "the batch does not end"
        status = agent.status()

    summary = service.get("/timeslice/summary")
    batch = service.get(f"/v1/batches/{bid}")
    out = service.http().get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()
    answers = [json.loads(line) for line in out]
    seen = collections.Counter(a["custom_id"] for a in answers)
    assert handoffs > max(FAULTS) and batch["status"] == "completed"
    assert batch["error_file_id"] is None and batch["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    assert set(seen) == set(ids) and max(seen.values()) == 1, "a custom_id is missing or answered twice"
    assert all(a["response"]["body"]["choices"][0]["text"].startswith(f"echo:{a['custom_id']}|") for a in answers)
    assert status["ladder"].get("abort") == 1 and status["ladder"].get("kill") == 1, status["ladder"]
    assert status["tenant"]["supervisor"]["restarts"] == 2 and "SIGKILL" in status["tenant"]["supervisor"]["last_exit"]
    assert summary["lines"]["retried"] > 0, "no line was hit by a fault: the test did not test"
    assert service.starts == 2
