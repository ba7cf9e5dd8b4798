"""The batch service under an adversary: a key on every call, its files its user's alone; a full or damaged database,
lines no server could read and the agent down each lose nothing; what OpenAI refuses refused in its error shape."""

from __future__ import annotations

import os
import stat

import pytest

pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from timeslice_verl.batch.app import make_app  # noqa: E402
from timeslice_verl.batch.auth import KEY_ENV, NoKey, RequireKey, client_key, service_keys  # noqa: E402
from timeslice_verl.batch.store import Store, StoreError, StoreUnavailable  # noqa: E402

KEY = "k" * 24
CALLS = [("get", "/v1/files"), ("get", "/v1/files/file_x/content"), ("delete", "/v1/files/file_x"),
         ("get", "/v1/batches"), ("get", "/v1/batches/batch_x"), ("post", "/v1/batches/batch_x/cancel"),
         ("post", "/v1/batches"), ("get", "/timeslice/summary"), ("get", "/metrics")]


@pytest.fixture
def guarded(tmp_path):
    store = Store(tmp_path / "b.sqlite")
    app = make_app(store, models=lambda role: {"m"}, kick=lambda: None, summary=lambda: {"lines": {}}, metrics=lambda: b"",
                   max_file_bytes=4096)
    with TestClient(RequireKey(app, [KEY])) as client:
        yield client
    store.close()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key-wrong-key"}, {"Authorization": KEY},
                                     {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Basic {KEY}"}])
@pytest.mark.parametrize("method, path", CALLS)
def test_every_call_without_the_key_is_401_in_openais_shape(guarded, headers, method, path):
    resp = getattr(guarded, method)(path, headers=headers)
    assert resp.status_code == 401, (method, path, resp.status_code)
    error = resp.json()["error"]
    assert error["code"] == "invalid_api_key" and "Authorization: Bearer KEY" in error["message"]


def test_with_the_key_the_calls_answer_and_health_needs_none(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert guarded.get("/v1/batches", headers=auth).status_code == 200
    assert guarded.get("/v1/batches/batch_x", headers=auth).status_code == 404  # past the key: the API's own answer
    assert guarded.get("/health").status_code == 200


def test_the_key_is_made_once_private_and_read_back_by_clients(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    path = tmp_path / "state" / "batch.key"
    with pytest.raises(NoKey, match="start `timeslice-verl batch serve` once"):
        client_key(str(path))
    (key,), source = service_keys(str(path))
    assert source == str(path) and len(key) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert service_keys(str(path))[0] == [key] and key == client_key(str(path))  # not made again
    assert client_key(str(path), "given-key-given-key") == "given-key-given-key"
    monkeypatch.setenv(KEY_ENV, "from-the-env-from-the-env")
    assert service_keys(str(path)) == (["from-the-env-from-the-env"], KEY_ENV)
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(NoKey, match=KEY_ENV):
        service_keys(str(path))


@pytest.mark.parametrize("mode, message", [(0o644, "readable by others"), (0o622, "writable by others")])
def test_a_key_file_others_can_read_or_write_is_refused(tmp_path, monkeypatch, mode, message):
    monkeypatch.delenv(KEY_ENV, raising=False)
    path = tmp_path / "batch.key"
    path.write_text(KEY)
    path.chmod(mode)
    with pytest.raises(NoKey, match=message):
        client_key(str(path))
    with pytest.raises(ValueError, match=message):
        service_keys(str(path))


def test_a_key_file_that_is_a_link_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    (tmp_path / "real").write_text(KEY)
    (tmp_path / "batch.key").symlink_to(tmp_path / "real")
    with pytest.raises(ValueError, match="symbolic link"):
        service_keys(str(tmp_path / "batch.key"))


def test_an_explicit_database_is_made_0600_in_a_0700_directory(tmp_path):
    old = os.umask(0o022)
    try:
        Store(tmp_path / "new" / "b.sqlite").close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new" / "b.sqlite").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700


def test_a_database_others_can_write_or_in_a_shared_directory_is_refused(tmp_path):
    planted = tmp_path / "b.sqlite"
    planted.write_bytes(b"")
    planted.chmod(0o666)
    with pytest.raises(StoreError, match="timeslice.batch.db: .* is writable by others"):
        Store(planted)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(StoreError, match="directory .* is writable by others"):
        Store(shared / "b.sqlite")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to plant a file owned by another user")
def test_a_database_another_user_made_is_refused(tmp_path):
    planted = tmp_path / "b.sqlite"
    planted.write_bytes(b"")
    planted.chmod(0o600)
    os.chown(planted, 12345, 12345)
    with pytest.raises(StoreError, match="belongs to uid 12345"):
        Store(planted)


# --------------------------------------------------------------------------- 4-8. a full or damaged database, bad lines, no agent


def test_a_full_database_is_a_json_error_naming_the_cause_and_the_feeder_holds_then_resumes(tmp_path):
    """Item 4: SQLite's own page limit stands in for a full disk (the same error: database or disk is full)."""
    import asyncio

    from timeslice_verl.batch.concurrency import Policy
    from timeslice_verl.batch.feeder import Feeder
    from timeslice_verl.batch.gate import Gate

    store = Store(tmp_path / "b.sqlite")
    pages = store.query("PRAGMA page_count")[0][0]
    store.db.execute(f"PRAGMA max_page_count={pages + 1}")
    app = make_app(store, models=lambda role: {"m"}, kick=lambda: None, summary=lambda: {}, metrics=lambda: b"",
                   max_file_bytes=2**20)
    with TestClient(app) as client:
        resp = client.post("/v1/files", files={"file": ("in.jsonl", b"x" * 200_000)}, data={"purpose": "batch"})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "storage_unavailable"
    assert "disk is full" in resp.json()["error"]["message"] and str(tmp_path) in resp.json()["error"]["message"]

    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise StoreUnavailable("database or disk is full")  # what the store raises for SQLite's OperationalError
        return "written"

    feeder = Feeder(store, "http://127.0.0.1:9", Gate(None), policy=Policy())
    seen = []

    async def watch() -> str:
        task = asyncio.ensure_future(feeder._db(flaky))
        while not task.done():
            seen.append((feeder.healthy, feeder.problem))
            await asyncio.sleep(0)
        return task.result()

    assert asyncio.run(watch()) == "written" and len(calls) == 3
    assert (False, f"the database {store.path} cannot be written: database or disk is full") in seen
    assert feeder.healthy and feeder.problem == ""
    problem = make_app(store, models=lambda role: None, kick=lambda: None, summary=lambda: {}, metrics=lambda: b"",
                       max_file_bytes=1, problem=lambda: "the database cannot be written: disk full")
    with TestClient(problem) as client:
        assert client.get("/health").status_code == 503
    store.close()


@pytest.mark.parametrize("damage", ["header", "truncate", "page"])
def test_a_damaged_database_is_refused_at_start_naming_its_path(tmp_path, damage):
    """Item 5: header garbage, a truncated file, a bad page in the middle."""
    from timeslice_verl.batch.lines import parse

    path = tmp_path / "b.sqlite"
    store = Store(path)
    body = "\n".join(f'{{"custom_id": "c{i}", "method": "POST", "url": "/v1/completions", "body": {{"model": "m", "prompt": "{"x" * 400}"}}}}'
                     for i in range(400))
    store.create_batch("/v1/completions", "f", 86400, "24h", None, parse(body.encode(), "/v1/completions"))
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    data = bytearray(path.read_bytes())
    if damage == "header":
        data[:16] = b"not a database!!"
    elif damage == "truncate":
        data = data[: len(data) // 3]
    else:
        page = 4096
        middle = (len(data) // page // 2) * page
        data[middle:middle + page] = bytes(range(256)) * (page // 256)
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=f"timeslice.batch.db: {path} cannot be used"):
        Store(path)


@pytest.mark.parametrize("raw, message", [
    ('{"custom_id": "a\\ud800", "method": "POST", "url": "/v1/completions", "body": {"model": "m"}}',
     "custom_id holds a lone surrogate"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "\\udfff"}}',
     "body holds a lone"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "temperature": NaN}}',
     "NaN is not a JSON"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "top_p": Infinity}}',
     "Infinity is not a JSON"),
])
def test_a_line_no_server_could_read_refuses_the_batch_naming_it(tmp_path, raw, message):
    """Item 6: accepted but never sendable, it used to stay in flight for ever; now the file is refused whole."""
    store = Store(tmp_path / "b.sqlite")
    app = make_app(store, models=lambda role: {"m"}, kick=lambda: None, summary=lambda: {}, metrics=lambda: b"",
                   max_file_bytes=2**20)
    good = '{"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": {"model": "m"}}'
    with TestClient(app) as client:
        fid = client.post("/v1/files", files={"file": ("in.jsonl", f"{good}\n{raw}\n".encode())},
                          data={"purpose": "batch"}).json()["id"]
        resp = client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                "completion_window": "24h"})
    assert resp.status_code == 400 and resp.json()["error"]["message"].startswith("line 2 of the input file: ")
    assert message in resp.json()["error"]["message"] and store.batches() == []
    store.close()


def test_with_the_agent_down_no_line_goes_out_and_a_cancel_still_ends_the_batch(tmp_path, procs, vllm):
    """Items 7 and 8: the gate fails closed without the agent (a sleeping vLLM answers /health too), and settling
    does not wait for the gate."""
    from agent_support import eventually
    from batch_support import BatchServiceProc, write_requests

    service = BatchServiceProc(tmp_path, vllm.url, agent_socket=tmp_path / "run" / "no-agent.sock").start()
    procs.append(service)
    eventually(lambda: service.get("/timeslice/summary")["gate"]["source"] == "agent (not answering)",
               what="the gate sees no agent")
    write_requests(tmp_path / "in.jsonl", 50)
    with service.http() as http:
        fid = http.post("/v1/files", files={"file": ("in.jsonl", (tmp_path / "in.jsonl").read_bytes())},
                        data={"purpose": "batch"}).json()["id"]
        bid = http.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                             "completion_window": "24h"}).json()["id"]
        assert http.post(f"/v1/batches/{bid}/cancel").status_code == 200
        batch = eventually(lambda: (b := http.get(f"/v1/batches/{bid}").json())["status"] == "cancelled" and b,
                           what="the cancel ends the batch")
    assert batch["request_counts"] == {"total": 50, "completed": 0, "failed": 0}, "never sent: no failures, as OpenAI"
    stats = vllm.stats()
    assert stats["completed"] == 0 and stats["running"] == 0 and stats["waiting"] == 0


# --------------------------------------------------------------------------- the newcomer's path


def test_batch_commands_take_bare_settings_like_agent_and_status(tmp_path, procs, vllm):
    from click.testing import CliRunner

    from batch_support import BatchServiceProc
    from timeslice_verl.tools.cli import main

    service = BatchServiceProc(tmp_path, vllm.url).start()
    procs.append(service)
    settings = [f"timeslice.batch.port={service.port}", f"timeslice.batch.key_file={service.key_file}"]
    listed = CliRunner().invoke(main, ["batch", "status", *settings])
    assert listed.exit_code == 0 and listed.output.strip() == "no batch", listed.output
    key = CliRunner().invoke(main, ["batch", "key", settings[1]])
    assert key.exit_code == 0 and key.output.strip() == service.key
    mixed = CliRunner().invoke(main, ["batch", "status", settings[0], "--set", settings[1]])
    assert mixed.exit_code == 0, mixed.output
    wrong = CliRunner().invoke(main, ["batch", "status", "timeslice.batch.nope=1"])
    assert wrong.exit_code == 2 and "timeslice.batch.nope" in wrong.output


# --------------------------------------------------------------------------- OpenAI conformance (the low-severity rows)


@pytest.mark.parametrize("call, status, param", [
    (("get", "/v1/batches?limit=0"), 400, "limit"),
    (("get", "/v1/batches?limit=101"), 400, "limit"),
    (("get", "/v1/batches?limit=abc"), 400, "limit"),
    (("post", "/v1/batches", {"input_file_id": "f", "endpoint": "/v1/completions"}), 400, "completion_window"),
    (("post", "/v1/batches", {"input_file_id": "f", "endpoint": "/v1/completions", "completion_window": "24h",
                              "metadata": {f"k{i}": "v" for i in range(17)}}), 400, "metadata"),
    (("post", "/v1/batches", {"input_file_id": "f", "endpoint": "/v1/completions", "completion_window": "24h",
                              "metadata": {"k" * 65: "v"}}), 400, "metadata"),
    (("post", "/v1/batches", {"input_file_id": "f", "endpoint": "/v1/completions", "completion_window": "24h",
                              "metadata": {"k": "v" * 513}}), 400, "metadata"),
    (("post", "/v1/files", None), 400, "file"),
    (("post", "/v1/batches", b"{oops"), 400, "not JSON"),
    (("post", "/v1/batches", [1, 2]), 400, "the request body"),
    (("post", "/v1/batches", {"input_file_id": 7, "endpoint": "/v1/completions", "completion_window": "24h"}), 400,
     "input_file_id"),
])
def test_requests_openai_refuses_are_refused_in_its_error_shape(guarded, call, status, param):
    method, path, *body = call
    kw = {"json": body[0]} if body and body[0] is not None else {}
    if body and isinstance(body[0], bytes):
        kw = {"content": body[0], "headers": {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}}
    kw.setdefault("headers", {"Authorization": f"Bearer {KEY}"})
    resp = getattr(guarded, method)(path, **kw)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or "") + error["message"]


def test_has_more_is_exact(tmp_path):
    from timeslice_verl.batch.lines import parse

    store = Store(tmp_path / "b.sqlite")
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m"}}'
    for _ in range(3):
        store.create_batch("/v1/completions", "f", 86400, "24h", None, parse(line, "/v1/completions"))
    app = make_app(store, models=lambda role: None, kick=lambda: None, summary=lambda: {}, metrics=lambda: b"",
                   max_file_bytes=1)
    with TestClient(app) as client:
        assert client.get("/v1/batches?limit=3").json()["has_more"] is False
        page = client.get("/v1/batches?limit=2").json()
        assert page["has_more"] is True
        assert client.get(f"/v1/batches?limit=2&after={page['last_id']}").json()["has_more"] is False
    store.close()


def test_several_keys_each_open_the_service_and_their_batches_are_recorded_under_different_owners(tmp_path, monkeypatch):
    from timeslice_verl.batch.auth import owner_of

    monkeypatch.delenv(KEY_ENV, raising=False)
    path = tmp_path / "batch.key"
    path.write_text(f"{KEY}\n# the second team\n{'t' * 24}\n")
    path.chmod(0o600)
    keys, _ = service_keys(str(path))
    assert keys == [KEY, "t" * 24] and client_key(str(path)) == KEY
    seen = []
    app = FastAPI()

    @app.get("/who")
    def who(request: Request) -> dict:
        seen.append(request.state.owner)
        return {}

    with TestClient(RequireKey(app, keys)) as client:
        for k in keys:
            assert client.get("/who", headers={"Authorization": f"Bearer {k}"}).status_code == 200
        assert client.get("/who", headers={"Authorization": "Bearer nope-nope-nope-nope"}).status_code == 401
    assert seen == [owner_of(KEY), owner_of("t" * 24)] and KEY not in seen[0]
