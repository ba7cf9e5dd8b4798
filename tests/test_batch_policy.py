"""Keys' policies in the batch service: the key file's weight and token quotas, read again when it changes; owners
share the tenant by weight under saturation (tokens counted, on a step model of vLLM's continuous batching), and an
owner over its quota gets 429 with ``Retry-After`` while its running batch pauses, then resumes once the window
frees — the window moved by writing the lines' timestamps in the database, on SQLite and a real PostgreSQL."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest

from pg_support import server, service_app, store_fixture  # noqa: F401 (server: a fixture)

pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")

from fastapi.testclient import TestClient  # noqa: E402

from timeslice_verl.batch.auth import KEY_ENV, KeyRing, RequireKey  # noqa: E402
from timeslice_verl.batch.keys import KeyLineError, parse_keys, parse_line  # noqa: E402
from timeslice_verl.batch.lines import parse  # noqa: E402
from timeslice_verl.batch.policy import OwnerPolicy  # noqa: E402
from timeslice_verl.batch.store import Outcome, Store  # noqa: E402

CHAT = "/v1/chat/completions"
ADMIN, A, B = "admin-key-0123456789", "team-a-key-0123456789", "team-b-key-0123456789"


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _jsonl(n: int, max_tokens: int = 4, prefix: str = "r") -> bytes:
    return "".join(json.dumps({"custom_id": f"{prefix}{i}", "method": "POST", "url": CHAT,
                               "body": {"model": "m", "max_tokens": max_tokens, "messages": []}}) + "\n"
                   for i in range(n)).encode()


def _batch(store: Store, n: int, owner: str, max_tokens: int = 4) -> str:
    return store.create_batch(CHAT, "f", 86400, "24h", None, parse(_jsonl(n, max_tokens), CHAT), owner=owner)


def _key_file(path: Path, text: str) -> Path:
    """Write the key file (private, as the service wants it); a new size or time each write, as an edit has."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    path.chmod(0o600)
    os.utime(path, ns=(before + 10**9, before + 10**9))  # an edit within the file system's time granularity shows
    return path


store = store_fixture("policy")


def _client(store: Store, ring: KeyRing) -> TestClient:
    store.queue.quotas.policy_of = ring.policy
    app = service_app(store, problem=lambda: ring.problem)
    return TestClient(RequireKey(app, ring))


def _create(client: TestClient, key: str, n: int = 2, **extra) -> httpx.Response:
    """Upload ``n`` lines and make a batch of them as ``key``: the answer (the upload's, if it was refused)."""
    up = client.post("/v1/files", files={"file": ("in.jsonl", _jsonl(n))}, data={"purpose": "batch"},
                     headers=_as(key))
    if up.status_code != 200:
        return up
    return client.post("/v1/batches", json={"input_file_id": up.json()["id"], "endpoint": CHAT,
                                            "completion_window": "24h", **extra}, headers=_as(key))


# --------------------------------------------------------------------------- the key file's policy fields


def test_a_key_line_gives_its_owners_weight_and_quotas():
    got = parse_line(f"{A} owner=team-a weight=3 tokens_per_hour=1000 tokens_per_day=20000", first=False)
    assert got.policy == OwnerPolicy(weight=3.0, tokens_per_hour=1000, tokens_per_day=20000)
    assert parse_line(f"{A} owner=team-a", first=False).policy == OwnerPolicy()
    assert str(got.policy) == "weight=3 tokens_per_hour=1000 tokens_per_day=20000"


@pytest.mark.parametrize("fields, message", [
    ("weight=0", "owner 'team-a': weight='0' is not a number above 0 and at most 1000"),
    ("weight=-2", "weight='-2' is not a number above 0"),
    ("weight=nan", "weight='nan' is not a number above 0"),
    ("weight=heavy", "weight='heavy' is not a number"),
    ("tokens_per_hour=1.5", "owner 'team-a': tokens_per_hour='1.5' is not a whole number of tokens"),
    ("tokens_per_day=0", "tokens_per_day='0' is not a whole number of tokens from 1"),
    ("tokens_per_week=5", "'tokens_per_week=5' is not a field: after the key come owner=NAME"),
    ("weight=2 weight=3", "weight= is given twice"),
])
def test_a_bad_policy_field_is_refused_naming_the_line_owner_and_field(fields, message):
    with pytest.raises(KeyLineError, match=re.escape(message)) as refused:
        parse_keys([ADMIN, f"{A} owner=team-a {fields}"], "keys")
    assert str(refused.value).startswith("keys line 2: ") and A not in str(refused.value)


def test_an_owners_policy_is_one_over_its_keys_and_may_not_differ():
    keys = parse_keys([ADMIN, f"{A} owner=team-a weight=3", f"{B} owner=team-a tokens_per_hour=50"], "keys")
    assert keys[1].policy == keys[2].policy == OwnerPolicy(weight=3.0, tokens_per_hour=50)
    with pytest.raises(KeyLineError, match="keys line 3: owner 'team-a': weight=2 differs from line 2's weight=3"):
        parse_keys([ADMIN, f"{A} owner=team-a weight=3", f"{B} owner=team-a weight=2"], "keys")


# --------------------------------------------------------------------------- read again without a restart


def test_the_key_file_is_read_again_when_it_changes_without_a_restart(store, tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    path = _key_file(tmp_path / "batch.key", f"{ADMIN}\n{A} owner=team-a\n")
    ring = KeyRing.of(str(path))
    with _client(store, ring) as client:
        assert _create(client, A).status_code == 200
        assert _create(client, B).status_code == 401, "not a key yet"
        assert _create(client, A, priority=5).status_code == 403
        assert ring.policy("team-a") == OwnerPolicy()
        _key_file(path, f"{ADMIN}\n{A} owner=team-a priorities=0..5 weight=3 tokens_per_hour=900\n{B} owner=team-b\n")
        assert _create(client, B).status_code == 200, "the new key works at once"
        assert _create(client, A, priority=5).status_code == 200, "and the new priorities"
        assert ring.policy("team-a") == OwnerPolicy(weight=3.0, tokens_per_hour=900)
        assert store.queue.quotas.weight("team-a") == 3.0, "the claim's share sees it too"
        _key_file(path, f"{ADMIN}\n{A} owner=team-a weight=lots\n")  # a typo: the keys read before stay
        health = client.get("/health", headers=_as(ADMIN))
        assert health.status_code == 503 and "weight='lots'" in health.json()["error"]["message"]
        assert "line 2" in ring.problem and _create(client, B).status_code == 200
        _key_file(path, f"{ADMIN}\n{A} owner=team-a\n")
        assert _create(client, B).status_code == 401, "a key removed is refused at once"
        assert client.get("/health", headers=_as(ADMIN)).status_code == 200 and ring.problem == ""


# --------------------------------------------------------------------------- weights under saturation

SLOTS = 16
"""The tenant's lines in flight: always full while both owners have lines waiting (saturation)."""


def _saturate(store: Store, tokens_of: dict[str, int]) -> dict[str, int]:
    """Drive the claim as the feeder does against a step model of vLLM's continuous batching: each step every line
    in flight generates one token, a line ends after its ``max_tokens`` (its owner's, in ``tokens_of``), and the
    freed slots are claimed again. The tokens each owner received while every owner still had lines waiting."""
    running: list[list] = []  # [line, owner, tokens left]
    got = dict.fromkeys(tokens_of, 0)
    owner_of = {r["id"]: r["owner"] for r in store.query("SELECT id, owner FROM batches")}
    while True:
        for line in store.claim(SLOTS - len(running), "stand-in"):
            owner = owner_of[line.batch_id]
            running.append([line, owner, tokens_of[owner]])
        waiting = {r["owner"] for r in store.query("SELECT owner FROM batches WHERE queued > 0")}
        if waiting != set(tokens_of):  # one owner's lines all sent: its slots go to the others from here
            return got
        for slot in running:
            slot[2] -= 1
            got[slot[1]] += 1
        ended = [slot for slot in running if slot[2] == 0]
        running = [slot for slot in running if slot[2] > 0]
        store.record([Outcome(line, "done", response='{"ok": true}', tokens=tokens_of[owner])
                      for line, owner, _ in ended])


def test_two_owners_weighted_3_to_1_receive_tokens_3_to_1_under_saturation(store):
    ring = KeyRing(parse_keys([ADMIN, f"{A} owner=team-a weight=3", f"{B} owner=team-b weight=1"], "keys"))
    store.queue.quotas.policy_of = ring.policy
    # answers of different lengths: the share is of tokens (slots), not of lines
    tokens_of = {"team-a": 7, "team-b": 4}
    for owner in ("team-b", "team-a"):  # the lighter owner's batch first: creation order does not decide
        _batch(store, 160, owner, tokens_of[owner])
    got = _saturate(store, tokens_of)
    ratio = got["team-a"] / got["team-b"]
    assert sum(got.values()) > 20 * SLOTS and abs(ratio - 3) <= 0.3, got


def test_equal_weights_share_tokens_equally(store):
    tokens_of = {"team-a": 5, "team-b": 3}
    for owner in tokens_of:
        _batch(store, 120, owner, tokens_of[owner])
    got = _saturate(store, tokens_of)
    assert abs(got["team-a"] / got["team-b"] - 1) <= 0.1, got


# --------------------------------------------------------------------------- quotas: 429, pause, resume


def _answer(store: Store, lines: list, tokens: int) -> None:
    assert store.record([Outcome(ln, "done", response='{"ok": true}', tokens=tokens) for ln in lines]) == len(lines)


def _age(store: Store, seconds: int) -> None:
    """Move every answer ``seconds`` into the past, on the database's clock: the window slides without a wait."""
    with store.transaction() as db:
        db.execute("UPDATE lines SET done_at = done_at - ? WHERE state = 'done'", (seconds,))


def test_an_owner_over_its_quota_gets_429_and_its_running_batch_pauses_then_resumes(store, tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    path = _key_file(tmp_path / "batch.key", f"{ADMIN}\n{A} owner=team-a tokens_per_hour=100 tokens_per_day=150\n"
                                             f"{B} owner=team-b\n")
    ring = KeyRing.of(str(path))
    store.queue.quotas.check_s = 0.0  # each claim reads the usage again
    with _client(store, ring) as client:
        made = _create(client, A, n=10)
        assert made.status_code == 200, made.text
        bid = made.json()["id"]
        _answer(store, store.claim(6, "n"), 20)  # 120 tokens: over 100 an hour
        over = _create(client, A)
        assert over.status_code == 429, over.text
        error = over.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "tokens_per_hour=100" in error["message"]
        assert 3000 <= int(over.headers["Retry-After"]) <= 3600, over.headers  # when the answers leave the hour
        theirs = _create(client, B).json()["id"]
        claimed = store.claim(10, "n")
        assert {ln.batch_id for ln in claimed} == {theirs}, "team-a's batch paused; another owner's runs"
        _answer(store, claimed, 1)
        assert client.get(f"/v1/batches/{bid}", headers=_as(A)).json()["status"] == "in_progress", "paused, not failed"
        paused = client.get(f"/timeslice/batches/{bid}", headers=_as(A)).json()["paused"]
        assert "tokens_per_hour=100" in paused, "the batch says why it waits"
        _age(store, 3000)  # the answers left the hour's window 600 s from now
        assert 300 <= int(_create(client, A).headers["Retry-After"]) <= 600
        _age(store, 601)  # out of the hour; the day still holds 120 of 150
        resumed = store.claim(10, "n")
        assert [ln.batch_id for ln in resumed] == [bid] * 4, "the paused batch resumes where it was"
        _answer(store, resumed[:2], 20)  # the day: 160 of 150 (two lines still in flight: they are not cut)
        by_day = _create(client, A)
        assert by_day.status_code == 429 and "tokens_per_day=150" in by_day.json()["error"]["message"]
        assert store.claim(10, "n") == []
        _age(store, 86400)
        assert _create(client, A).status_code == 200
        assert client.get(f"/timeslice/batches/{bid}", headers=_as(A)).json()["paused"] is None
        _answer(store, resumed[2:] + store.claim(10, "n"), 1)
        assert client.get(f"/v1/batches/{bid}", headers=_as(A)).json()["request_counts"] == \
            {"total": 10, "completed": 10, "failed": 0}, "every line answered once"
