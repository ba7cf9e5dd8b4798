"""The batch service: its input-file rules, its store's exactly-once bookkeeping, its HTTP API's answers
to bad input, the OpenAI Python client against it, and the tenant supervisor bringing a killed server back."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from agent_support import AgentProc, eventually
from batch_support import BatchServiceProc, SupervisorProc, completed, create_batch, write_requests

pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")

from fastapi.testclient import TestClient  # noqa: E402

from timeslice_verl.batch.app import make_app  # noqa: E402
from timeslice_verl.batch.feeder import classify  # noqa: E402
from timeslice_verl.batch.lines import BatchRefused, RequestLine, parse  # noqa: E402
from timeslice_verl.batch.store import Store, StoreError  # noqa: E402
from timeslice_verl.supervisor.supervisor import TenantCommand  # noqa: E402

CHAT = "/v1/chat/completions"


def _line(cid, url=CHAT, model="m", **extra) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {"model": model, "messages": []}, **extra})


# --------------------------------------------------------------------------- the input file, line by line


@pytest.mark.parametrize("raw, message", [
    ("{not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps({"method": "POST", "url": CHAT, "body": {"model": "m"}}), "custom_id must be a string"),
    (json.dumps({"custom_id": "", "method": "POST", "url": CHAT, "body": {"model": "m"}}), "custom_id must be a string"),
    (_line("a\u0000"), "custom_id holds a NUL character"),
    (_line("a", method="GET"), "method 'GET' is not POST"),
    (_line("a", url="/v1/embeddings"), "is not this batch's endpoint"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": {"messages": []}}),
     "body must be an object with a model"),
    (_line("a", model="other"), "model 'other' is not served by the tenant (served: m)"),
])
def test_a_bad_line_refuses_the_file_naming_the_line_and_why(raw, message):
    with pytest.raises(BatchRefused) as refused:
        parse(f"{_line('ok')}\n{raw}\n{_line('later')}\n".encode(), CHAT, models={"m"})
    assert refused.value.line == 2 and refused.value.param == "input_file_id"
    assert refused.value.message.startswith("line 2 of the input file: ") and message in refused.value.message


@pytest.mark.parametrize("content, endpoint, message", [
    (b"", CHAT, "has no request"),
    (b"\n  \n", CHAT, "has no request"),
    (b"\xff\xfe", CHAT, "not UTF-8"),
    (_line("a").encode(), "/v1/embeddings", "endpoint '/v1/embeddings' is not supported"),
    (f"{_line('a')}\n{_line('b')}\n{_line('a')}\n".encode(), CHAT, "line 3 of the input file: custom_id 'a' is used twice (lines 1 and 3)"),
])
def test_a_file_that_cannot_be_a_batch_is_refused_naming_the_problem(content, endpoint, message):
    with pytest.raises(BatchRefused, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(content, endpoint)


@pytest.mark.parametrize("status, body, fate", [
    (200, {"choices": [{"finish_reason": "length"}]}, "done"),
    (200, {"choices": [{"finish_reason": "abort"}]}, "again"),  # the ladder's abort step
    (200, {"choices": []}, "again"),
    (200, "not an object", "again"),
    (500, {}, "again"), (503, {}, "again"), (429, {}, "again"), (408, {}, "again"),
    (400, {"message": "bad"}, "failed"), (404, {}, "failed"), (422, {}, "failed"),
])
def test_an_answer_decides_its_lines_fate(status, body, fate):
    assert classify(status, body)[0] == fate


# --------------------------------------------------------------------------- the store


def test_a_line_in_flight_when_the_service_dies_is_sent_again_and_recorded_once(tmp_path):
    store = Store(tmp_path / "b.sqlite")
    bid = store.create_batch(CHAT, "file_x", 86400, "24h", None, parse(f"{_line('a')}\n{_line('b')}".encode(), CHAT))
    first = store.claim(10)
    store.done(first[0], {"status_code": 200, "body": {}}, tokens=3)
    store.close()  # "kill -9": b is in flight, its answer never recorded

    store = Store(tmp_path / "b.sqlite")
    assert store.recover() == 1
    again = store.claim(10)
    assert [line.custom_id for line in again] == ["b"] and again[0].attempts == 2
    store.done(again[0], {"status_code": 200, "body": {}}, tokens=2)
    store.done(again[0], {"status_code": 200, "body": {"late": True}}, tokens=9)  # a duplicate answer: ignored
    assert store.batch(bid)["status"] == "completed"
    assert [r["custom_id"] for r in store.results(bid, "done")] == ["a", "b"]
    assert store.totals() == {"queued": 0, "inflight": 0, "done": 2, "failed": 0, "retried": 1, "tokens": 5}


def test_a_cancelled_batch_fails_what_was_not_sent_and_waits_for_what_was(tmp_path):
    store = Store(tmp_path / "b.sqlite")
    bid = store.create_batch(CHAT, "f", 86400, "24h", None, parse("\n".join(_line(c) for c in "abc").encode(), CHAT))
    sent = store.claim(1)
    store.cancel(bid)
    assert store.batch(bid)["status"] == "cancelling"
    store.done(sent[0], {"status_code": 200, "body": {}}, 1)
    assert store.batch(bid)["status"] == "cancelled"
    errors = [json.loads(r["error"])["code"] for r in store.results(bid, "failed")]
    assert errors == ["batch_cancelled", "batch_cancelled"]
    assert store.counts(bid)["failed"] == 0, "lines never sent are in the error file, not counted as failed (OpenAI)"


# --------------------------------------------------------------------------- the API's answers to bad input


@pytest.fixture
def api(tmp_path):
    store = Store(tmp_path / "b.sqlite")
    kicks = []
    app = make_app(store, models=lambda role: {"m"}, kick=lambda: kicks.append(1), summary=lambda: {}, metrics=lambda: b"",
                   max_file_bytes=4096)
    with TestClient(app) as client:
        yield client, store, kicks
    store.close()


def _upload(client, content: bytes, purpose: str = "batch"):
    return client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": purpose})


@pytest.mark.parametrize("purpose, content, status, message", [
    ("fine-tune", b"x", 400, "purpose 'fine-tune' is not supported"),
    ("batch", b"x" * 5000, 413, "larger than 4096 bytes"),
])
def test_an_upload_the_service_does_not_take_is_a_4xx_naming_it(api, purpose, content, status, message):
    client, store, _ = api
    resp = _upload(client, content, purpose)
    assert resp.status_code == status and message in resp.json()["error"]["message"]
    assert store.files() == []


@pytest.mark.parametrize("body, status, message", [
    ({"input_file_id": "FILE", "endpoint": "/v1/embeddings", "completion_window": "24h"}, 400, "endpoint '/v1/embeddings'"),
    ({"input_file_id": "FILE", "endpoint": CHAT, "completion_window": "48h"}, 400, "completion_window '48h'"),
    ({"input_file_id": "file_nope", "endpoint": CHAT, "completion_window": "24h"}, 404, "no input file 'file_nope'"),
    ({"input_file_id": "DUP", "endpoint": CHAT, "completion_window": "24h"}, 400, "custom_id 'a' is used twice"),
])
def test_a_batch_the_service_cannot_run_is_a_4xx_and_nothing_else_changes(api, body, status, message):
    client, store, kicks = api
    good = _upload(client, f"{_line('a')}\n".encode()).json()["id"]
    dup = _upload(client, f"{_line('a')}\n{_line('a')}\n".encode()).json()["id"]
    body = {**body, "input_file_id": {"FILE": good, "DUP": dup}.get(body["input_file_id"], body["input_file_id"])}
    resp = client.post("/v1/batches", json=body)
    assert resp.status_code == status and message in resp.json()["error"]["message"], resp.json()
    assert store.batches() == [] and kicks == []
    assert client.post("/v1/batches", json={"input_file_id": good, "endpoint": CHAT,
                                            "completion_window": "24h"}).status_code == 200


def test_bad_lines_refuse_the_batch_naming_the_first_and_nothing_runs(api):
    """As OpenAI's API: the whole file is checked before a batch exists; a batch never runs a part of its file."""
    client, store, kicks = api
    fid = _upload(client, f"{_line('a')}\n{{oops\n{_line('b', model='zz')}\n".encode()).json()["id"]
    resp = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": CHAT, "completion_window": "24h"})
    assert resp.status_code == 400 and resp.json()["error"]["message"].startswith("line 2 of the input file: not JSON")
    assert store.batches() == [] and kicks == []
    assert client.get("/v1/batches/batch_nope").status_code == 404
    assert client.post("/v1/batches", content=b"[").status_code == 400


# --------------------------------------------------------------------------- the real service, the OpenAI client


def test_the_openai_python_client_creates_polls_and_downloads_a_batch(tmp_path, procs, vllm):
    openai = pytest.importorskip("openai", reason="the OpenAI client is in the test extra")
    service = BatchServiceProc(tmp_path, vllm.url).start()
    procs.append(service)
    ids = write_requests(tmp_path / "in.jsonl", 40, endpoint=CHAT)
    client = openai.OpenAI(base_url=f"{service.url}/v1", api_key=service.key, max_retries=0)
    with (tmp_path / "in.jsonl").open("rb") as f:
        upload = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h",
                                  metadata={"owner": "test"})
    batch = eventually(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, what="batch done")
    assert batch.request_counts.completed == 40 and batch.request_counts.failed == 0 and batch.metadata == {"owner": "test"}
    answers = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(a["custom_id"] for a in answers) == ids
    assert all(a["response"]["body"]["choices"][0]["message"]["content"].startswith(f"echo:{a['custom_id']}")
               for a in answers)
    assert batch.id in [b.id for b in client.batches.list()]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_answers_with_unicode_line_separators_stay_one_line_each_for_every_reader(tmp_path, procs, vllm):
    """vLLM writes its answers' text as it is (U+2028, U+2029, U+0085 raw inside JSON strings: valid JSON, but line
    ends to Python's ``splitlines``): the output file escapes them, so each answer is one line however it is split."""
    service = BatchServiceProc(tmp_path, vllm.url).start()
    procs.append(service)
    prompts = {f"req-{i}": f"a\u2028b\u2029c\x85d {i}" for i in range(6)}
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                                                           "body": {"model": "m", "prompt": p, "max_tokens": 2}}) + "\n"
                                               for cid, p in prompts.items()))
    client = service.http()
    batch = completed(client, create_batch(client, tmp_path / "in.jsonl"))
    text = client.get(f"/v1/files/{batch['output_file_id']}/content").text
    answers = [json.loads(line) for line in text.splitlines()]
    assert len(answers) == len(prompts) and "\u2028" not in text and "\x85" not in text
    assert all(a["response"]["body"]["choices"][0]["text"].startswith(f"echo:{prompts[a['custom_id']]}") for a in answers)


def test_the_cli_submits_follows_and_downloads(tmp_path, procs, vllm):
    service = BatchServiceProc(tmp_path, vllm.url).start()
    procs.append(service)
    write_requests(tmp_path / "in.jsonl", 20)
    submitted = run_cli("batch", "submit", str(tmp_path / "in.jsonl"), "--url", service.url, "--api-key", service.key)
    assert submitted.exit_code == 0, submitted.output
    bid = submitted.output.splitlines()[0]
    assert "completed" in submitted.output and "20/20 done" in submitted.output
    got = run_cli("batch", "results", bid, "-o", str(tmp_path / "out.jsonl"), "--url", service.url, "--api-key", service.key)
    assert got.exit_code == 0 and "20 answer(s)" in got.output
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 20
    missing = run_cli("batch", "status", "batch_nope", "--url", service.url, "--api-key", service.key)
    assert missing.exit_code == 1 and "no batch 'batch_nope'" in missing.output
    down = run_cli("batch", "status", "--url", "http://127.0.0.1:9", "--api-key", "k" * 20)
    assert down.exit_code == 1 and "no batch service answers" in down.output


def run_cli(*args: str):
    from click.testing import CliRunner

    from timeslice_verl.tools.cli import main

    return CliRunner().invoke(main, list(args))


# --------------------------------------------------------------------------- the tenant supervisor


@pytest.mark.parametrize("argv, message", [
    ([], "no command"),
    (["vllm", "serve", "m", "--port", "x"], "--port 'x' is not a number"),
    (["vllm", "serve", "m", "--gpu-memory-utilization", "1.5"], "not in (0, 1]"),
])
def test_a_tenant_command_the_supervisor_cannot_run_is_refused(argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        TenantCommand.parse(argv)


def test_a_tenant_command_gets_sleep_mode_and_its_url():
    cmd = TenantCommand.parse(["vllm", "serve", "m", "--host", "::1", "--port=8011", "--gpu-memory-utilization", "0.3"])
    assert cmd.argv[-1] == "--enable-sleep-mode" and cmd.url == "http://[::1]:8011" and cmd.gpu_utilization == 0.3
    assert TenantCommand.parse(["vllm", "serve", "m", "--enable-sleep-mode"]).argv.count("--enable-sleep-mode") == 1


def test_the_supervisor_brings_a_killed_tenant_back_and_the_agent_takes_it(tmp_path, procs):
    sock = tmp_path / "run" / "agent.sock"
    tenant = SupervisorProc(tmp_path, sock)
    procs.append(tenant)
    agent = AgentProc(tmp_path, tenant_url=tenant.url).start()
    procs.append(agent)
    first = eventually(lambda: (agent.status().get("tenant") or {}).get("supervisor"), what="registered")
    assert first["restarts"] == 0
    os.kill(first["pid"], signal.SIGKILL)
    back = eventually(lambda: (s := (agent.status().get("tenant") or {}).get("supervisor")) and s["pid"] != first["pid"]
                      and s, what="the restarted tenant registered")
    assert back["restarts"] == 1 and "killed by SIGKILL" in back["last_exit"]
    assert httpx.get(f"{tenant.url}/health", timeout=10).is_success
    tenant.stop()
    assert tenant.proc.returncode == 0 and not _listening(tenant.url), "the supervisor left its server behind"


def _listening(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
        return True
    except httpx.HTTPError:
        return False


# --------------------------------------------------------------------------- what the node shows of it


def test_watch_owner_answers_once_the_gpu_changes_hands(agent, procs):
    """The batch service's gate: no polling — the agent answers when the owner is no longer the one seen."""
    import threading

    from agent_support import spawn_worker

    procs.append(spawn_worker("job-a"))
    with agent.client() as watcher, agent.client() as trainer:
        assert watcher.status()["owner"] == "tenant"
        seen: list[dict] = []
        t = threading.Thread(target=lambda: seen.append(watcher.watch_owner("tenant", 60)))
        t.start()
        trainer.acquire("job-a")
        t.join(90)
        assert seen and seen[0]["owner"] == "transitioning"  # from the tenant's yield on: no line sent into it
        assert watcher.watch_owner("transitioning", 60)["owner"] == "job:job-a"
        assert watcher.watch_owner("job:job-a", 0.05)["owner"] == "job:job-a"  # unchanged: answered at the bound


def test_status_shows_the_supervisor_the_ladder_and_the_batch_without_control_characters():
    from timeslice_verl.tools.status import render_batch, render_status

    status = {"agent": {}, "owner": "tenant", "ladder": {"kill": 1, "last": "12:00 kill: \x1b[2J"},
              "tenant": {"urls": ["http://127.0.0.1:8000"], "state": "awake", "version": "0.24\r", "error": "bad\x07",
                         "wedged": [], "supervisor": {"pid": 42, "restarts": 2, "last_exit": "killed by SIGKILL\x1b[31m",
                                                      "restart_s": 3.25}}}
    text = render_status(status)
    assert "supervisor: server pid 42, 2 restart(s); last: killed by SIGKILL\\x1b[31m (back in 3.2 s)" in text
    assert "reclaim ladder: kill 1x" in text and "\x1b" not in text and "\x07" not in text and "\r" not in text
    batch = render_batch({"tenant": "http://t", "gate": {"open": True, "source": "agent"}, "tokens_per_s_open": 512.0,
                          "lines": {"queued": 5, "inflight": 2, "done": 90, "retried": 3, "failed": 1},
                          "tenants": [{"tenant": "http://t\x1b[2J", "limit": 256, "inflight": 2, "sent": 99,
                                       "answered": 90, "shed": 7}],
                          "open_batches": [{"id": "batch_x", "status": "in_progress", "total": 100, "completed": 90,
                                            "failed": 1}]})
    assert "completed 90, retried 3, failed 1; 512 tokens/s" in batch and "batch_x  in_progress 91/100 (91 %)" in batch
    assert "2 requests open at the tenant, of a limit of 256 (it follows vLLM); 99 sent, 90 answered, 7 shed when the limit fell" in batch
    assert "\x1b" not in batch


@pytest.mark.parametrize("answer", [b"<html>proxy error</html>", b"\x1b[2Jnot json", b"[1, 2]"])
def test_doctor_names_a_tenant_that_answers_what_vllm_would_not(answer):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from timeslice_verl.tools.doctor import _check_one_vllm

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        check = _check_one_vllm(f"http://127.0.0.1:{server.server_address[1]}", "")
    finally:
        server.shutdown()
    assert not check.ok and "not vLLM's JSON" in check.detail and "\x1b" not in check.detail


def test_a_tenant_back_while_the_trainer_holds_the_gpu_is_put_to_sleep_at_once(tmp_path, procs):
    """A restarted server registers awake; the agent makes it yield before it competes with the trainer."""
    from agent_support import FakeVllmProc, spawn_worker

    first = FakeVllmProc()
    procs += [first, spawn_worker("job-a")]
    agent = AgentProc(tmp_path, tenant_url=first.url).start()
    procs.append(agent)
    with agent.client() as trainer:
        trainer.acquire("job-a")
        first.stop()  # the tenant dies while the trainer computes; a new one comes up on the same address
        back = FakeVllmProc("--port", first.url.rsplit(":", 1)[1])
        procs.append(back)
        trainer.register_tenant([back.url], supervisor={"pid": back.proc.pid, "restarts": 1, "last_exit": "crashed"})
        eventually(back.sleeping, what="the returned tenant asleep")
        assert trainer.status()["owner"] == "job:job-a"
