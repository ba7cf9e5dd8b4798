"""Isolation between the batch service's API keys: each file and batch is its key's owner's, another owner's id
answers exactly as a missing one, lists are an owner's alone, an admin key reaches all, and each key asks only for
its priorities — on SQLite and on a real PostgreSQL server. Also the key file's lines, and ``/health`` saying why it
is unhealthy (the database's address) only to a caller with a key."""

from __future__ import annotations

import json

import httpx
import pytest

from pg_support import Postgres, need_postgres, server, service_app, store_fixture  # noqa: F401 (server: a fixture)

pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")

from fastapi.testclient import TestClient  # noqa: E402

from timeslice_verl.batch.app import make_app  # noqa: E402
from timeslice_verl.batch.auth import KEY_ENV, NoKey, RequireKey, api_keys, client_key  # noqa: E402
from timeslice_verl.batch.keys import (  # noqa: E402
    ApiKey, KeyLineError, KeyRole, Priorities, owner_of, parse_keys, parse_line)

CHAT = "/v1/chat/completions"
ADMIN, A, A2, B, PLAIN = "admin-key-0123456789", "team-a-key-0123456789", "team-a-second-key-01", \
    "team-b-key-0123456789", "plain-key-0123456789"
KEY_FILE = f"""# the service's own key (plain, the first): admin
{ADMIN}
{A}  owner=team-a   # a team
{A2} owner=team-a role=user
{B}  owner=team-b priorities=-5..5
{PLAIN}
"""
MISSING_FILE, MISSING_BATCH = "file_" + "0" * 24, "batch_" + "0" * 24
"""Ids of the shape the service gives, that name nothing."""


store = store_fixture("keys")


@pytest.fixture
def api(store):
    app = service_app(store)
    with TestClient(RequireKey(app, parse_keys(KEY_FILE.splitlines(), "keys"))) as client:
        yield client


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _line(cid: str, model: str = "m") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": CHAT, "body": {"model": model, "messages": []}})


def _upload(client: TestClient, key: str) -> str:
    content = f"{_line('a')}\n{_line('b')}\n".encode()
    resp = client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}, headers=_as(key))
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def _create(client: TestClient, key: str, fid: str, **extra) -> httpx.Response:
    body = {"input_file_id": fid, "endpoint": CHAT, "completion_window": "24h", **extra}
    return client.post("/v1/batches", json=body, headers=_as(key))


def _batch(client: TestClient, key: str) -> str:
    made = _create(client, key, _upload(client, key))
    assert made.status_code == 200, made.text
    return made.json()["id"]


def _call(client: TestClient, key: str, call: tuple[str, str], oid: str) -> httpx.Response:
    method, path = call
    if path == "input_file_id":
        return _create(client, key, oid)
    return client.request(method.upper(), path.format(id=oid), headers=_as(key))


def _same_as_missing(client: TestClient, key: str, call: tuple[str, str], theirs: str, missing: str) -> None:
    foreign, none = _call(client, key, call, theirs), _call(client, key, call, missing)
    assert foreign.status_code == none.status_code == 404, (foreign.text, none.text)
    assert foreign.json() == json.loads(none.text.replace(missing, theirs))
    assert foreign.headers["content-type"] == none.headers["content-type"]


# --------------------------------------------------------------------------- another owner's id, as a missing one


FILE_CALLS = [("get", "/v1/files/{id}"), ("get", "/v1/files/{id}/content"), ("delete", "/v1/files/{id}"),
              ("post", "input_file_id")]


@pytest.mark.parametrize("call", FILE_CALLS, ids=lambda c: f"{c[0]} {c[1]}")
def test_another_owners_file_answers_exactly_as_a_missing_one_and_stays(api, call):
    fid = _upload(api, A)
    _same_as_missing(api, B, call, fid, MISSING_FILE)
    _same_as_missing(api, PLAIN, call, fid, MISSING_FILE)
    assert api.get(f"/v1/files/{fid}", headers=_as(A)).status_code == 200
    assert _line("a") in api.get(f"/v1/files/{fid}/content", headers=_as(A)).text
    assert api.get("/v1/batches", headers=_as(ADMIN)).json()["data"] == []  # nothing made of it


BATCH_CALLS = [("get", "/v1/batches/{id}"), ("post", "/v1/batches/{id}/cancel"), ("get", "/timeslice/batches/{id}"),
               ("get", "/v1/files/file-out-{id}"), ("get", "/v1/files/file-err-{id}"),
               ("get", "/v1/files/file-out-{id}/content"), ("get", "/v1/files/file-err-{id}/content")]


@pytest.mark.parametrize("call", BATCH_CALLS, ids=lambda c: f"{c[0]} {c[1]}")
def test_another_owners_batch_and_its_result_files_answer_exactly_as_missing_ones(api, call):
    bid = _batch(api, A)
    _same_as_missing(api, B, call, bid, MISSING_BATCH)
    assert api.get(f"/v1/batches/{bid}", headers=_as(A)).json()["status"] == "in_progress"  # not cancelled
    assert _call(api, A, call, bid).status_code == 200  # its owner's answer


def test_keys_that_name_one_owner_share_its_files_and_batches(api):
    bid = _batch(api, A)
    assert api.get(f"/v1/batches/{bid}", headers=_as(A2)).status_code == 200
    assert api.post(f"/v1/batches/{bid}/cancel", headers=_as(A2)).json()["status"] in ("cancelling", "cancelled")


# --------------------------------------------------------------------------- lists, and the admin


def _ids(client: TestClient, key: str, path: str) -> set[str]:
    resp = client.get(path, headers=_as(key))
    assert resp.status_code == 200, resp.text
    return {x["id"] for x in resp.json()["data"]}


def test_each_key_lists_its_owners_objects_alone_and_an_admin_lists_all(api):
    ba, bb, bp = _batch(api, A), _batch(api, B), _batch(api, PLAIN)
    files = {k: _ids(api, k, "/v1/files") for k in (A, A2, B, PLAIN, ADMIN)}
    assert len(files[A]) == len(files[B]) == len(files[PLAIN]) == 1 and files[A] == files[A2]
    assert files[A] | files[B] | files[PLAIN] == files[ADMIN] and len(files[ADMIN]) == 3
    assert [_ids(api, k, "/v1/batches") for k in (A, A2, B, PLAIN)] == [{ba}, {ba}, {bb}, {bp}]
    assert _ids(api, ADMIN, "/v1/batches") == {ba, bb, bp}
    # paging after another owner's batch (made after ba) answers as after a missing one: it says nothing of bb
    assert api.get(f"/v1/batches?after={bb}", headers=_as(A)).json() == \
        api.get(f"/v1/batches?after={MISSING_BATCH}", headers=_as(A)).json()
    assert _ids(api, ADMIN, f"/v1/batches?after={bb}") == {ba}


def test_the_summary_shows_a_key_its_owners_open_batches_alone(store):
    def summary() -> dict:  # the service's: every open batch
        return {"lines": store.totals(), "open_batches": [{"id": r["id"]} for r in store.batches()]}

    app = make_app(store, models=lambda role: {"m"}, kick=lambda: None, metrics=lambda: b"", max_file_bytes=1 << 20,
                   summary=summary)
    with TestClient(RequireKey(app, parse_keys(KEY_FILE.splitlines(), "keys"))) as client:
        ba, bb = _batch(client, A), _batch(client, B)
        shown = {k: {b["id"] for b in client.get("/timeslice/summary", headers=_as(k)).json()["open_batches"]}
                 for k in (A, B, ADMIN)}
        assert shown == {A: {ba}, B: {bb}, ADMIN: {ba, bb}}


def test_an_admin_key_reaches_and_acts_on_every_owners_objects(api):
    fid, bid = _upload(api, A), _batch(api, B)
    admin = _as(ADMIN)
    assert api.get(f"/v1/files/{fid}", headers=admin).status_code == 200
    assert _line("a") in api.get(f"/v1/files/{fid}/content", headers=admin).text
    assert api.get(f"/timeslice/batches/{bid}", headers=admin).status_code == 200
    assert api.get(f"/v1/files/file-err-{bid}/content", headers=admin).status_code == 200
    made = _create(api, ADMIN, fid)
    assert made.status_code == 200 and api.get(f"/v1/batches/{made.json()['id']}", headers=_as(A)).status_code == 404
    assert api.post(f"/v1/batches/{bid}/cancel", headers=admin).status_code == 200
    assert api.delete(f"/v1/files/{fid}", headers=admin).json()["deleted"] is True
    assert api.get(f"/v1/files/{fid}", headers=_as(A)).status_code == 404


# --------------------------------------------------------------------------- priorities


@pytest.mark.parametrize("key, priority, allowed", [
    (A, 0, None), (A, -100, None), (A, 1, "-100..0"), (PLAIN, 1, "-100..0"),
    (B, 5, None), (B, -5, None), (B, 6, "-5..5"), (B, -6, "-5..5"), (ADMIN, 100, None), (ADMIN, -100, None),
])
def test_a_priority_outside_the_keys_is_refused_naming_the_allowed_ones(api, key, priority, allowed):
    fid = _upload(api, key)
    resp = _create(api, key, fid, priority=priority)
    if allowed is None:
        assert resp.status_code == 200, resp.text
        return
    assert resp.status_code == 403
    error = resp.json()["error"]
    assert error["code"] == "priority_not_allowed" and error["param"] == "priority"
    assert f"priority {priority} is not allowed" in error["message"] and f"priorities {allowed}" in error["message"]
    assert api.get("/v1/batches", headers=_as(ADMIN)).json()["data"] == []
    assert _create(api, key, fid).status_code == 200  # the file still there: nothing lost


# --------------------------------------------------------------------------- the key file


@pytest.mark.parametrize("line, first, owner, role, priorities", [
    (A, True, owner_of(A), KeyRole.admin, "-100..100"),  # the service's own key, as it made it
    (A, False, owner_of(A), KeyRole.user, "-100..0"),
    (f"{A} owner=team-a", True, "team-a", KeyRole.user, "-100..0"),  # fields: no key is admin unless it says so
    (f"  {A}\towner=ops role=admin  ", False, "ops", KeyRole.admin, "-100..100"),
    (f"{A} role=admin priorities=0..5", False, owner_of(A), KeyRole.admin, "0..5"),
    (f"{A} priorities=..5", False, owner_of(A), KeyRole.user, "-100..5"),
    (f"{A} priorities=-5..", False, owner_of(A), KeyRole.user, "-5..100"),
    (f"{A} priorities=3", False, owner_of(A), KeyRole.user, "3"),
    (f"{A} owner=key-0123abcd role=user # keeps a plain key's batches", False, "key-0123abcd", KeyRole.user, "-100..0"),
])
def test_a_key_line_names_its_owner_role_and_priorities(line, first, owner, role, priorities):
    got = parse_line(line, first)
    assert (got.key, got.owner, got.role, str(got.priorities)) == (A, owner, role, priorities)
    assert A not in repr(got)


@pytest.mark.parametrize("line, message", [
    ("short-key", "at least 16 printable characters"),
    (f"{A} team-a", "'team-a' is not a field: after the key come owner=NAME"),
    (f"{A} colour=red", "'colour=red' is not a field"),
    (f"{A} owner=a owner=b", "owner= is given twice"),
    (f"{A} owner=", "owner='': an owner is 1 to 64"),
    (f"{A} owner=../etc", "owner='../etc'"),
    (f"{A} role=root", "role='root' is not one of user, admin"),
    (f"{A} priorities=5..1", "priorities 5..1 must lie within -100..100, the lower end first"),
    (f"{A} priorities=0..200", "must lie within -100..100"),
    (f"{A} priorities=high", "priorities='high' is not LOW..HIGH or one number"),
])
def test_a_bad_key_line_is_refused_saying_what_is_wrong(line, message):
    with pytest.raises(KeyLineError, match=message.replace(".", r"\.").replace("(", r"\(")):
        parse_line(line, first=False)


def test_a_bad_key_file_names_the_file_and_the_line(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    path = tmp_path / "batch.key"
    path.write_text(f"# comment\n\n{A} owner=team-a\n{B} role=boss\n")
    path.chmod(0o600)
    with pytest.raises(NoKey, match=f"{path} line 4: role='boss'"):
        api_keys(str(path))
    path.write_text(f"{A}\n{A} owner=team-a\n")
    with pytest.raises(NoKey, match=f"{path} line 2: this key is already on an earlier line"):
        api_keys(str(path))


def test_the_service_and_its_clients_read_the_key_file_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    path = tmp_path / "batch.key"
    path.write_text(KEY_FILE)
    path.chmod(0o600)
    keys, source = api_keys(str(path))
    assert source == str(path) and [k.key for k in keys] == [ADMIN, A, A2, B, PLAIN]
    assert keys[0] == ApiKey(ADMIN, owner_of(ADMIN), KeyRole.admin, Priorities(-100, 100))
    assert keys[3] == ApiKey(B, "team-b", KeyRole.user, Priorities(-5, 5))
    assert client_key(str(path)) == ADMIN  # the first key alone, without its fields
    path.write_text(f"{A} owner=team-a role=admin\n")
    assert client_key(str(path)) == A
    monkeypatch.setenv(KEY_ENV, B)
    assert api_keys(str(path)) == ([ApiKey(B, owner_of(B), KeyRole.admin, Priorities(-100, 100))], KEY_ENV)


# --------------------------------------------------------------------------- /health


@pytest.mark.postgresql
def test_health_tells_an_anonymous_probe_nothing_of_the_database(tmp_path, procs):
    """The real service over a PostgreSQL server that stops: a probe learns it is unhealthy, a key holder why."""
    from agent_support import eventually
    from batch_support import BatchServiceProc

    need_postgres()
    pg = Postgres().start()
    try:
        dsn = pg.database("gone")
        key_path = tmp_path / "batch.key"
        key_path.write_text(f"{ADMIN}\n{A} owner=team-a\n")
        key_path.chmod(0o600)
        service = BatchServiceProc(tmp_path, "http://127.0.0.1:9", env={"TIMESLICE_BATCH_DSN": dsn},
                                   extra=("timeslice.batch.store=postgresql",)).start()
        procs.append(service)
        with httpx.Client(base_url=service.url, timeout=30) as http:
            fid = http.post("/v1/files", files={"file": ("in.jsonl", b"x\n")}, data={"purpose": "batch"},
                            headers=_as(A)).json()["id"]
            assert http.get(f"/v1/files/{fid}", headers=_as(B)).status_code == 401  # not a key of this file
            assert _ids(http, A, "/v1/files") == {fid} and http.get("/v1/files", headers=_as(ADMIN)).status_code == 200
            pg.stop("immediate")
            down = eventually(lambda: (r := http.get("/health")).status_code == 503 and r, what="/health unhealthy",
                              timeout=120)
            told = http.get("/health", headers=_as(A))
        where = str(pg.sock)
        assert down.json()["error"]["code"] == "unhealthy" and where not in down.text and "postgresql" not in down.text
        assert "send the API key" in down.json()["error"]["message"]
        assert told.status_code == 503 and where in told.text, told.text
    finally:
        pg.close()
