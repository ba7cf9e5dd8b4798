"""Who got what from the valleys: the pro rata share of the GPU-seconds among the lines in flight (it sums to the
seconds used), each batch's OpenAI ``usage`` and its extension field, the owners' figures in the status and the
metrics (labels bounded by the key file), the ``gpu_seconds_per_day`` quota (429, pause, resume) — on SQLite and a
real PostgreSQL, and end to end against the stand-in vLLM's own count of the tokens it generated."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import pytest

from pg_support import ENGINES, fresh_database, server, service_app, store_fixture  # noqa: F401 (server: a fixture)

pytest.importorskip("fastapi", reason="the batch service needs the 'batch' extra (in the test extra)")

from fastapi.testclient import TestClient  # noqa: E402

from timeslice_verl.batch.auth import KEY_ENV, KeyRing, RequireKey  # noqa: E402
from timeslice_verl.batch.keys import KeyLineError, parse_keys, parse_line  # noqa: E402
from timeslice_verl.batch.lines import parse  # noqa: E402
from timeslice_verl.batch.policy import OwnerPolicy  # noqa: E402
from timeslice_verl.batch.store import Outcome, Store  # noqa: E402
from timeslice_verl.batch.usage import FIELD, OTHER, Valley, collect  # noqa: E402

CHAT = "/v1/chat/completions"
ADMIN, A, B = "admin-key-0123456789", "team-a-key-0123456789", "team-b-key-0123456789"

store = store_fixture("usage")


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _jsonl(n: int, prefix: str = "r") -> bytes:
    return "".join(json.dumps({"custom_id": f"{prefix}{i}", "method": "POST", "url": CHAT,
                               "body": {"model": "m", "max_tokens": 4, "messages": []}}) + "\n"
                   for i in range(n)).encode()


def _batch(store: Store, n: int, owner: str) -> str:
    return store.create_batch(CHAT, "f", 86400, "24h", None, parse(_jsonl(n), CHAT), owner=owner)


# --------------------------------------------------------------------------- the share of the GPU-seconds


class Clock:
    """A gate's open seconds, moved by hand."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_gpu_seconds_are_shared_pro_rata_among_the_lines_in_flight_and_sum_to_the_seconds_used():
    gate = Clock()
    valley = Valley(gate, clock=lambda: 7200.0)
    gate.t = 2.0  # open, nothing in flight: wasted
    valley.start("a")
    gate.t = 3.0  # a alone: 1 s
    valley.start("b")
    gate.t = 7.0  # a and b: 2 s each
    valley.end("a", "batch_1", "team-a")
    gate.t = 8.0  # b alone: 1 s
    valley.start("c")
    valley.end("b", "batch_2", "team-b")
    gate.t = 10.0
    valley.end("c", "batch_2", "team-b")  # c alone: 2 s
    gate.t = 10.5  # wasted again
    figures = valley.figures()
    assert valley.take() == {("batch_1", "team-a"): 3.0, ("batch_2", "team-b"): 5.0}
    assert valley.take() == {}, "each second goes to the database once"
    assert (figures["lent_s"], figures["used_s"], figures["wasted_s"]) == (10.5, 8.0, 2.5)
    assert figures["hours"] == [{"hour": 7200, "lent_s": 10.5, "used_s": 8.0, "wasted_s": 2.5}]


# --------------------------------------------------------------------------- a batch's usage, its owner's figures


def test_a_batchs_usage_is_openais_and_its_valley_figures_sum_per_owner(store):
    bid, theirs = _batch(store, 3, "team-a"), _batch(store, 2, "team-b")
    lines = store.claim(5, "n")
    mine = [ln for ln in lines if ln.batch_id == bid]
    assert {ln.owner for ln in mine} == {"team-a"}
    outcomes = [Outcome.answer(ln, '{"ok": true}', {"prompt_tokens": 10 + ln.idx, "completion_tokens": 4})
                for ln in mine[:2]]
    outcomes.append(Outcome(mine[2], "queued", delay_s=0.0, cut=True))  # a yield cut it: queued again
    spent = {(bid, "team-a"): 6.0, (theirs, "team-b"): 2.5}
    assert store.record(outcomes, spent) == 3
    (again,) = store.claim(5, "n")
    assert store.record([Outcome.answer(again, "{}", {"prompt_tokens": 12, "completion_tokens": 3})],
                        {(bid, "team-a"): 1.0}) == 1
    with TestClient(service_app(store)) as client:
        batch = client.get(f"/v1/batches/{bid}").json()
    assert batch["status"] == "completed"
    assert batch["usage"] == {"input_tokens": 10 + 11 + 12, "output_tokens": 4 + 4 + 3, "total_tokens": 44,
                              "input_tokens_details": {"cached_tokens": 0},
                              "output_tokens_details": {"reasoning_tokens": 0}}
    ext = batch[FIELD]
    assert ext["gpu_seconds"] == 7.0 and ext["cut_tries"] == 1 and ext["lines_sent"] == 3
    assert ext["queue_wait_s"] >= 0 and ext["line_wait_s"]["total"] >= 0
    from timeslice_verl.batch.usage import owners

    figures = {o["owner"]: o for o in owners(store)}
    assert figures["team-a"]["gpu_seconds"] == 7.0 and figures["team-b"]["gpu_seconds"] == 2.5
    assert figures["team-a"]["gpu_seconds_last_day"] == 7.0 and figures["team-a"]["output_tokens"] == 11
    assert figures["team-b"]["output_tokens"] == 0 and figures["team-b"]["lines_sent"] == 2


def test_the_metrics_label_owners_the_key_file_names_and_fold_the_rest_never_a_batch(store):
    ring = KeyRing(parse_keys([ADMIN, f"{A} owner=team-a"], "keys"))
    ids = {owner: _batch(store, 1, owner) for owner in ("team-a", "gone-1", "gone-2")}
    lines = store.claim(3, "n")
    store.record([Outcome.answer(ln, "{}", {"prompt_tokens": 2, "completion_tokens": 1}) for ln in lines],
                 {(bid, owner): 1.0 for owner, bid in ids.items()})
    service = SimpleNamespace(keys=ring, store=store,
                              feeders=[SimpleNamespace(url="http://tenant", valley=Valley(lambda: 0.0))])
    families = {f.name: f for f in collect(service)}
    gpu = families["timeslice_batch_owner_gpu_seconds"]
    assert {s.labels["owner"]: s.value for s in gpu.samples} == {"team-a": 1.0, OTHER: 2.0}
    labels = {k for f in families.values() for s in f.samples for k in s.labels}
    assert labels == {"owner", "tenant", "use"}, "bounded: configured owners, tenants, three uses"
    assert not any(bid in str(s.labels) for f in families.values() for s in f.samples for bid in ids.values())
    assert {s.labels["use"] for s in families["timeslice_batch_valley_seconds"].samples} == {"lent", "used", "wasted"}


# --------------------------------------------------------------------------- the GPU-seconds quota


def test_a_gpu_seconds_quota_is_read_from_the_key_file_and_a_bad_one_refused():
    assert parse_line(f"{A} owner=team-a gpu_seconds_per_day=3600", first=False).policy == \
        OwnerPolicy(gpu_seconds_per_day=3600.0)
    with pytest.raises(KeyLineError, match=re.escape("keys line 2: owner 'team-a': gpu_seconds_per_day='-1' is not "
                                                     "a number of seconds above 0")):
        parse_keys([ADMIN, f"{A} owner=team-a gpu_seconds_per_day=-1"], "keys")


def _create(client: TestClient, key: str) -> httpx.Response:
    up = client.post("/v1/files", files={"file": ("in.jsonl", _jsonl(4))}, data={"purpose": "batch"}, headers=_as(key))
    return client.post("/v1/batches", json={"input_file_id": up.json()["id"], "endpoint": CHAT,
                                            "completion_window": "24h"}, headers=_as(key))


def test_an_owner_over_its_gpu_seconds_per_day_gets_429_and_its_batch_pauses_then_resumes(store):
    ring = KeyRing(parse_keys([ADMIN, f"{A} owner=team-a gpu_seconds_per_day=40", f"{B} owner=team-b"], "keys"))
    store.queue.quotas.policy_of, store.queue.quotas.check_s = ring.policy, 0.0
    with TestClient(RequireKey(service_app(store), ring)) as client:
        made = _create(client, A)
        assert made.status_code == 200, made.text
        bid = made.json()["id"]
        first = store.claim(2, "n")
        assert store.record([Outcome.answer(ln, "{}", {"completion_tokens": 1}) for ln in first],
                            {(bid, "team-a"): 45.0}) == 2
        over = _create(client, A)
        assert over.status_code == 429, over.text
        assert over.json()["error"]["code"] == "rate_limit_exceeded"
        assert "45.0 valley GPU-seconds used in the last day, at or over its gpu_seconds_per_day=40" in \
            over.json()["error"]["message"]
        assert 86000 <= int(over.headers["Retry-After"]) <= 86460, over.headers  # when its minute leaves the day
        theirs = _create(client, B).json()["id"]
        claimed = store.claim(10, "n")
        assert {ln.batch_id for ln in claimed} == {theirs}, "team-a's batch paused; another owner's runs"
        assert "gpu_seconds_per_day=40" in client.get(f"/timeslice/batches/{bid}", headers=_as(A)).json()["paused"]
        with store.transaction() as db:  # the minute leaves the day's window, on the database's clock
            db.execute("UPDATE gpu_usage SET minute = minute - 1441")
        assert [ln.batch_id for ln in store.claim(10, "n")] == [bid] * 2, "resumed where it was"
        assert _create(client, A).status_code == 200


# --------------------------------------------------------------------------- end to end: the stand-in's own count


@pytest.mark.parametrize("engine", ENGINES)
def test_two_keys_attribution_adds_up_to_the_stand_ins_tokens_and_the_nodes_used_seconds(
        request, tmp_path, procs, vllm, monkeypatch, engine):
    from batch_support import BatchServiceProc, completed, create_batch, output_lines, write_requests

    monkeypatch.delenv(KEY_ENV, raising=False)
    env, extra = {}, ()
    if engine == "postgresql":
        env = {"TIMESLICE_BATCH_DSN": fresh_database(request.getfixturevalue("server"), "usage_e2e")}
        extra = ("timeslice.batch.store=postgresql",)
    service = BatchServiceProc(tmp_path / "svc", vllm.url, env=env, extra=extra)
    service.key_file.write_text(f"{ADMIN}\n{A} owner=team-a\n{B} owner=team-b\n")
    service.key_file.chmod(0o600)
    procs.append(service.start())
    got: dict[str, dict] = {}
    for key, owner, n in ((A, "team-a", 24), (B, "team-b", 16)):
        path = tmp_path / f"{owner}.jsonl"
        write_requests(path, n, endpoint=CHAT, max_tokens=lambda i: 2 + i % 5)
        with httpx.Client(base_url=service.url, timeout=60, headers=_as(key)) as http:
            got[owner] = {"id": create_batch(http, path, CHAT)}
    for key, owner in ((A, "team-a"), (B, "team-b")):
        with httpx.Client(base_url=service.url, timeout=60, headers=_as(key)) as http:
            batch = completed(http, got[owner]["id"])
            answers = [a["response"]["body"]["usage"] for a in output_lines(http, batch)]
        got[owner].update(batch=batch, answers=answers)
    generated = vllm.stats()["generated"]
    summary = httpx.get(f"{service.url}/timeslice/summary", headers=_as(ADMIN), timeout=30).json()
    figures = {o["owner"]: o for o in summary["owners"]}
    for owner, g in got.items():
        usage = g["batch"]["usage"]
        assert usage["output_tokens"] == sum(u["completion_tokens"] for u in g["answers"]) == \
            figures[owner]["output_tokens"]
        assert usage["input_tokens"] == sum(u["prompt_tokens"] for u in g["answers"]) == figures[owner]["input_tokens"]
        assert g["batch"][FIELD]["gpu_seconds"] > 0 and g["batch"][FIELD]["lines_sent"] == len(g["answers"])
    assert figures["team-a"]["output_tokens"] + figures["team-b"]["output_tokens"] == generated, \
        "the owners' tokens are the server's own count"
    valley = summary["valley"]
    assert valley["used_s"] > 0 and abs(valley["lent_s"] - valley["used_s"] - valley["wasted_s"]) < 0.01
    assert figures["team-a"]["gpu_seconds"] + figures["team-b"]["gpu_seconds"] == pytest.approx(valley["used_s"],
                                                                                                 abs=0.01)
    metrics = httpx.get(f"{service.url}/metrics", headers=_as(ADMIN), timeout=30).text
    assert f'timeslice_batch_owner_output_tokens_total{{owner="team-a"}} {float(figures["team-a"]["output_tokens"])}' \
        in metrics
    assert re.findall(r'timeslice_batch_owner_gpu_seconds_total\{owner="([^"]+)"\}', metrics) == ["team-a", "team-b"]


def test_the_status_and_batch_status_show_who_got_what():
    from timeslice_verl.batch.client import describe
    from timeslice_verl.tools.status import render_batch

    shown = render_batch({"tenant": "http://t", "gate": {"open": True, "source": "agent"},
                          "valley": {"lent_s": 100.0, "used_s": 80.0, "wasted_s": 20.0},
                          "owners": [{"owner": "team-a", "input_tokens": 12, "output_tokens": 34, "gpu_seconds": 5.25,
                                      "gpu_seconds_last_day": 5.25, "cut_tries": 2}]})
    assert "valleys: 100 s lent, 80 s used, 20 s wasted" in shown
    assert "owner team-a: 12 tokens in, 34 out, 5.2 GPU-s (5.2 in the last day), 2 tries cut by a yield" in shown
    line = describe({"id": "batch_1", "status": "completed", "request_counts": {"total": 2, "completed": 2, "failed": 0},
                     "endpoint": CHAT, "usage": {"input_tokens": 12, "output_tokens": 34},
                     FIELD: {"gpu_seconds": 5.25}})
    assert "12 tokens in, 34 out, 5.2 GPU-s" in line
