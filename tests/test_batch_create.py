"""A batch's creation over HTTP, on SQLite and on a real PostgreSQL server: the input file is checked whole before
a batch is usable, a bad file is refused naming its first bad line and leaves no batch, a file deleted while it is
read never becomes a part of a batch, and a cancel while the batch is created is answered ``cancelling`` and ends
once, with the batch's whole total."""

from __future__ import annotations

import json
import threading
from typing import Any, Callable

import pytest

from pg_support import server, store_fixture  # noqa: F401 (server: a fixture)

pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")

from fastapi.testclient import TestClient  # noqa: E402

from timeslice_verl.batch.app import make_app  # noqa: E402
from timeslice_verl.batch.status import ENDED  # noqa: E402
from timeslice_verl.batch.store import Store  # noqa: E402

CHAT = "/v1/chat/completions"
CHUNK = 4096
"""The service's chunk: a file of a few thousand lines is dozens of chunks."""


def _line(cid: str, **fields: Any) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": CHAT,
                       "body": {"model": "m", "messages": [{"role": "user", "content": f"say {cid}"}]}, **fields})


def _file(n: int) -> bytes:
    return "".join(_line(f"r{i}") + "\n" for i in range(n)).encode()


store = store_fixture("create")


@pytest.fixture
def api(store, monkeypatch):
    import timeslice_verl.batch.store as store_mod

    monkeypatch.setattr(store_mod, "INSERT_CHUNK", 64)  # many transactions of lines before the file's end
    kicks: list[int] = []
    app = make_app(store, models=lambda role: {"m"}, kick=lambda: kicks.append(1), summary=lambda: {},
                   metrics=lambda: b"", max_file_bytes=64 << 20, chunk_bytes=CHUNK)
    with TestClient(app) as client:
        yield client, store, kicks


def _upload(client, content: bytes) -> str:
    resp = client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
    assert resp.status_code == 200, resp.text
    return resp.json()["id"]


def _create(client, fid: str):
    return client.post("/v1/batches", json={"input_file_id": fid, "endpoint": CHAT, "completion_window": "24h"})


def _on_chunk(store: Store, seq: int, action: Callable[[], None]) -> None:
    """Run ``action`` once, just before the creation reads the file's chunk ``seq``: the interleaving is fixed."""
    real = store.query

    def query(sql: str, args: tuple = ()) -> list[Any]:
        if "FROM file_chunks" in sql and len(args) == 2 and args[1] == seq and not done.is_set():
            done.set()
            action()
        return real(sql, args)

    done = threading.Event()
    store.query = query  # type: ignore[method-assign]


def _nothing_left(store: Store) -> bool:
    return store.batches() == [] and store.query("SELECT COUNT(*) AS n FROM lines")[0]["n"] == 0


# --------------------------------------------------------------------------- the input file deleted meanwhile


def test_an_input_file_deleted_while_a_batch_is_created_from_it_is_a_409_and_no_batch(api):
    client, store, kicks = api
    fid = _upload(client, _file(3000))
    deleted: list[int] = []
    _on_chunk(store, 10, lambda: deleted.append(client.delete(f"/v1/files/{fid}").status_code))
    resp = _create(client, fid)
    assert deleted == [200]
    assert resp.status_code == 409, resp.text
    error = resp.json()["error"]
    assert error["code"] == "file_deleted" and error["param"] == "input_file_id" and "deleted while" in error["message"]
    assert _nothing_left(store) and kicks == []


def test_an_input_file_deleted_once_it_was_read_whole_makes_a_whole_batch(api):
    client, store, _ = api
    content = _file(3000)
    fid = _upload(client, content)
    deleted: list[int] = []
    chunks = -(-len(content) // CHUNK)
    _on_chunk(store, chunks, lambda: deleted.append(client.delete(f"/v1/files/{fid}").status_code))  # the look past the end
    resp = _create(client, fid)
    assert deleted == [200] and resp.status_code == 200, resp.text
    assert resp.json()["request_counts"]["total"] == 3000
    assert store.query("SELECT COUNT(*) AS n FROM lines")[0]["n"] == 3000


# --------------------------------------------------------------------------- a cancel while it is created


def test_a_cancel_while_the_batch_is_created_answers_cancelling_and_it_ends_once_with_its_total(api):
    client, store, kicks = api
    fid = _upload(client, _file(3000))
    seen: list[dict] = []

    def cancel_then_look() -> None:
        bid = store.batches()[0]["id"]
        seen.append(client.post(f"/v1/batches/{bid}/cancel").json())
        seen.append(client.get(f"/v1/batches/{bid}").json())

    _on_chunk(store, 10, cancel_then_look)
    resp = _create(client, fid)
    assert resp.status_code == 200, resp.text
    seen += [resp.json(), client.get(f"/v1/batches/{resp.json()['id']}").json()]
    assert [b["status"] for b in seen] == ["cancelling", "cancelling", "cancelled", "cancelled"]
    ends = {(b["status"], json.dumps(b["request_counts"]), b["cancelled_at"]) for b in seen if b["status"] in ENDED}
    assert len(ends) == 1, ends
    final = seen[-1]
    assert final["request_counts"] == {"total": 3000, "completed": 0, "failed": 0}, "cancelled lines are not failures"
    assert final["cancelling_at"] is not None and final["in_progress_at"] is None and final["output_file_id"] is None
    errors = client.get(f"/v1/files/{final['error_file_id']}/content").text.splitlines()
    assert len(errors) == 3000 and {json.loads(e)["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert store.claim(10) == []


# --------------------------------------------------------------------------- a bad line refuses the file


@pytest.mark.parametrize("bad, why", [
    ("{oops", "not JSON"),
    (json.dumps({"method": "POST", "url": CHAT, "body": {"model": "m"}}), "custom_id must be a string"),
    (json.dumps({"custom_id": "x", "url": CHAT, "body": {"model": "m"}}), "method is missing"),
    (json.dumps({"custom_id": "x", "method": "POST", "body": {"model": "m"}}), "url is missing"),
    (json.dumps({"custom_id": "x", "method": "POST", "url": CHAT}), "body must be an object with a model"),
    (_line("x", url="/v1/completions"), "url '/v1/completions' is not this batch's endpoint"),
    (_line("r7"), "custom_id 'r7' is used twice (lines 8 and 2501)"),
    (json.dumps({"custom_id": "x", "method": "POST", "url": CHAT, "body": {"model": "zz"}}),
     "model 'zz' is not served by the tenant (served: m)"),
    (json.dumps({"custom_id": "a\u0000b", "method": "POST", "url": CHAT, "body": {"model": "m"}}),
     "custom_id holds a NUL character"),
])
def test_a_bad_line_deep_in_the_file_refuses_the_batch_naming_it_and_leaves_nothing(api, bad, why):
    client, store, kicks = api
    lines = [_line(f"r{i}") for i in range(3000)]
    lines.insert(2500, bad)
    fid = _upload(client, ("\n".join(lines) + "\n").encode())
    resp = _create(client, fid)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["message"].startswith("line 2501 of the input file: ") and why in error["message"], error
    assert error["param"] == "input_file_id" and _nothing_left(store) and kicks == []


def test_bytes_that_are_not_utf8_are_refused_naming_their_own_line(api):
    client, store, _ = api
    content = bytearray(_file(3000))
    at = content.index(b'"r2999"')  # the last line, dozens of chunks in
    content[at + 2] = 0xFF
    resp = _create(client, _upload(client, bytes(content)))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"].startswith("line 3000 of the input file: not UTF-8 (invalid start byte")
    assert _nothing_left(store)


def test_a_nul_inside_the_body_is_json_text_and_is_kept(api):
    client, store, _ = api
    fid = _upload(client, (_line("a", body={"model": "m", "prompt": "x\u0000y"}) + "\n").encode())
    resp = _create(client, fid)
    assert resp.status_code == 200, resp.text
    [line] = store.claim(1)
    assert json.loads(line.body)["prompt"] == "x\u0000y"


def test_an_input_file_id_with_a_nul_is_a_400(api):
    client, store, _ = api
    resp = client.post("/v1/batches", json={"input_file_id": "file_\u0000", "endpoint": CHAT, "completion_window": "24h"})
    assert resp.status_code == 400 and "NUL" in resp.json()["error"]["message"], resp.text
    assert _nothing_left(store)


class Killed(BaseException):
    """The creator's process ends here: nothing after it runs (its cleanup neither)."""


def test_a_creation_cancelled_meanwhile_whose_creator_stopped_ends_cancelled_once_its_lease_runs_out(store, monkeypatch):
    import timeslice_verl.batch.store as store_mod
    from timeslice_verl.batch.lines import parse

    real, dead = store.transaction, threading.Event()

    def transaction():
        if dead.is_set():
            raise Killed
        return real()

    def rows():
        yield from parse((_line("a") + "\n").encode(), CHAT)
        assert store.cancel(store.batches()[0]["id"])
        dead.set()
        raise Killed

    monkeypatch.setattr(store_mod, "CREATING_S", -1.0)  # the creation's lease has run out by the time anyone looks
    monkeypatch.setattr(store, "transaction", transaction)
    with pytest.raises(Killed):
        store.create_batch(CHAT, "f", 86400, "24h", None, rows())
    monkeypatch.setattr(store, "transaction", real)
    [stuck] = store.batches()
    assert stuck["status"] == "cancelling", "a cancel while it is created waits for the creation's end"
    if not store.dialect.shared:  # (several nodes: settling also takes over creations whose lease ran out)
        store.settle_open()
        assert store.batch(stuck["id"])["status"] == "cancelling", "settling alone does not end a creation under way"
    store.recover(everything=False)
    ended = store.batch(stuck["id"])
    assert ended["status"] == "cancelled" and ended["cancelled_at"] is not None and ended["total"] == 0
    assert json.loads(ended["errors"])["data"][0]["code"] == "interrupted" and store.claim(10) == []


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/files/file-%00"), ("GET", "/v1/files/file-%00/content"), ("DELETE", "/v1/files/file-%00"),
    ("GET", "/v1/batches/batch_%00"), ("POST", "/v1/batches/batch_%00/cancel"), ("GET", "/v1/batches?after=batch_%00"),
])
def test_a_nul_in_the_path_or_query_is_a_400_naming_it(api, method, path):
    client, store, _ = api
    resp = client.request(method, path)
    assert resp.status_code == 400 and "NUL" in resp.json()["error"]["message"], resp.text
    assert client.get("/v1/files").status_code == 200  # the service goes on
