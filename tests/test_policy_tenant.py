"""The policy tenant: vLLM's weight-transfer routes on the stand-in, and the client that pushes a version."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from agent_support import eventually
from batch_support import BatchServiceProc, completed, create_batch
from timeslice_verl.standin.server import StandinServer
from timeslice_verl.validate.policy import PolicyBusy, PolicyError, PolicyTenant, Update


@pytest.fixture
def server():
    s = StandinServer(token_s=0.01).start()
    yield s
    s.stop()


def _update(n: int = 2) -> Update:
    return Update({"names": [f"w{i}" for i in range(n)], "dtype_names": ["bfloat16"] * n, "shapes": [[4, 4]] * n,
                   "packed": False, "ipc_handles_pickled": "eA=="}, 32 * n)


def _complete(url: str) -> dict:
    return httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 3}, timeout=30).json()


@pytest.mark.parametrize("path, body, status, message", [
    ("/init_weight_transfer_engine", {}, 400, "init_info"),
    ("/start_weight_update", {}, 500, "not initialised"),
    ("/update_weights", {"update_info": {"names": ["a"], "dtype_names": [], "shapes": [[1]], "ipc_handles": [{}]}},
     400, "same size"),
    ("/update_weights", {"update_info": {"names": ["a"], "dtype_names": ["f"], "shapes": [[1]]}}, 400, "ipc_handles"),
    ("/finish_weight_update", {}, 500, "no weight update under way"),
])
def test_the_stand_in_refuses_what_vllm_refuses_naming_it(server, path, body, status, message):
    resp = httpx.post(f"{server.url}{path}", json=body)
    assert resp.status_code == status and message in resp.text


def test_a_push_loads_its_version_and_every_answer_names_the_version_it_was_generated_with(server):
    policy = PolicyTenant(server.url)
    try:
        assert _complete(server.url)["timeslice_weight_version"] == 0
        push = policy.push(2, [_update(3), _update(2)])
        assert (push.version, push.tensors, push.bytes) == (2, 5, 160) and policy.version == 2
        assert _complete(server.url)["timeslice_weight_version"] == 2
        policy.push(4, [_update()])
        updates = server.engine.stats()["weights"]["updates"]
        assert [(u["version"], u["generating"]) for u in updates] == [(2, 0), (4, 0)]
        assert not server.engine.stats()["paused"], "the tenant serves again after a push"
    finally:
        policy.close()


def test_a_push_is_refused_while_the_tenant_holds_requests_so_no_answer_mixes_versions(server):
    policy = PolicyTenant(server.url)
    answers: list[dict] = []
    slow = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{server.url}/v1/completions", json={"model": "m", "prompt": "p", "max_tokens": 100}, timeout=60).json()))
    try:
        slow.start()
        eventually(lambda: server.engine.stats()["running"] == 1, what="a request generating")
        with pytest.raises(PolicyBusy, match="holds 1 request"):
            policy.push(2, [_update()])
        slow.join()
        assert answers[0]["timeslice_weight_version"] == 0 and server.engine.stats()["weights"]["version"] == 0
        policy.push(2, [_update()])
        assert _complete(server.url)["timeslice_weight_version"] == 2
    finally:
        policy.close()


def test_a_push_that_fails_midway_leaves_the_version_unknown_and_the_tenant_serving(server):
    policy = PolicyTenant(server.url)
    bad = Update({"names": ["a", "b"], "dtype_names": ["f"], "shapes": [[1]], "ipc_handles": [{}]})
    try:
        with pytest.raises(PolicyError, match="update_weights: HTTP 400"):
            policy.push(2, [_update(), bad])
        assert policy.version is None and not server.engine.stats()["paused"]
        policy.push(4, [_update()])
        assert policy.version == 4
    finally:
        policy.close()


# --------------------------------------------------------------------------- the batch service routes by role


def _submit(client: httpx.Client, tmp_path, name: str, model: str, n: int, **extra) -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"{name}-{i}", "method": "POST", "url": "/v1/completions",
                                        "body": {"model": model, "prompt": f"{name}-{i}", "max_tokens": 2}}) + "\n"
                            for i in range(n)))
    return create_batch(client, path, **extra)


def _answers(client: httpx.Client, bid: str) -> list[dict]:
    batch = completed(client, bid)
    return [json.loads(x) for key in ("output_file_id", "error_file_id") if batch.get(key)
            for x in client.get(f"/v1/files/{batch[key]}/content").text.split("\n") if x]


def test_validation_runs_go_to_the_policy_tenant_alone_and_users_batches_never_do(tmp_path, procs):
    users, policy = StandinServer(model="m").start(), StandinServer(model="policy").start()
    try:
        service = BatchServiceProc(tmp_path, users.url, extra=(f"timeslice.validate.policy_url={policy.url}",)).start()
        procs.append(service)
        client = service.http()
        user = _submit(client, tmp_path, "user", "m", 30)
        run = _submit(client, tmp_path, "val", "policy", 20, priority=100, tenant_role="policy")
        (tmp_path / "wrong.jsonl").write_text(json.dumps({"custom_id": "w", "method": "POST", "url": "/v1/completions",
                                                          "body": {"model": "m", "prompt": "w"}}) + "\n")
        fid = client.post("/v1/files", files={"file": ("wrong.jsonl", (tmp_path / "wrong.jsonl").read_bytes())},
                          data={"purpose": "batch"}).json()["id"]
        wrong = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                 "completion_window": "24h", "tenant_role": "policy"})
        assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "model_not_found", wrong.text
        assert "line 1 of the input file: model 'm' is not served" in wrong.json()["error"]["message"]
        assert all(a["error"] is None for a in _answers(client, user) + _answers(client, run))
        assert users.engine.stats()["completed"] == 30 and policy.engine.stats()["completed"] == 20
        bad = client.post("/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/completions",
                                               "completion_window": "24h", "tenant_role": "judge"})
        assert bad.status_code == 400 and "tenant_role" in bad.text
    finally:
        users.stop()
        policy.stop()


def test_the_agents_tenant_list_may_name_the_policy_tenant_the_users_lines_still_skip_it():
    from timeslice_verl.batch.service import tenant_urls
    from timeslice_verl.config.schema import load_settings

    settings = load_settings({"tenant": {"urls": ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]},
                              "validate": {"policy_url": "http://127.0.0.1:8001/"}})
    assert tenant_urls(settings) == ["http://127.0.0.1:8000"]


def test_status_names_a_validation_run_and_its_version(tmp_path, procs):
    """``timeslice-verl status``'s batch lines: a validation run says which version it validates."""
    from timeslice_verl.names import VALIDATION_VERSION
    from timeslice_verl.tools.status import render_batch

    users, policy = StandinServer(model="m").start(), StandinServer(model="policy").start()
    policy.engine.pause("keep")  # the run stays open while status is read
    try:
        service = BatchServiceProc(tmp_path, users.url, extra=(f"timeslice.validate.policy_url={policy.url}",)).start()
        procs.append(service)
        client = service.http()
        run = _submit(client, tmp_path, "val", "policy", 4, tenant_role="policy", metadata={VALIDATION_VERSION: "6"})
        user = _submit(client, tmp_path, "user", "m", 2, metadata={"owner": "me"})
        _answers(client, user)
        shown = render_batch(service.get("/timeslice/summary"))
        assert f"{run}  in_progress" in shown and "validation of version 6" in shown, shown
    finally:
        policy.engine.resume()
        users.stop()
        policy.stop()
