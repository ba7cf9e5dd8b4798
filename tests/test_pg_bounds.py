"""The batch queue on PostgreSQL waits on nothing without a bound: a feeder frozen inside a transaction (a real
process, stopped) holds the others up only until the server ends its transaction, then resumes, reconnects and goes
on, nothing lost nor answered twice; and with the server itself stopped the API answers 503 in OpenAI's shape."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pg_support import Postgres, need_postgres, server  # noqa: F401 (server: a fixture)
from timeslice_verl.batch.lines import parse
from timeslice_verl.batch.store import Line, Outcome, Store, StoreUnavailable

CHAT = "/v1/completions"
FROZEN = Path(__file__).with_name("pg_frozen_feeder.py")


def _store(dsn: str) -> Store:
    from timeslice_verl.batch.pg import PostgresEngine

    return Store(PostgresEngine(dsn))


def _batch(store: Store, n: int, tag: str) -> str:
    text = "\n".join(json.dumps({"custom_id": f"{tag}{i}", "method": "POST", "url": CHAT, "body": {"model": "m"}})
                     for i in range(n))
    return store.create_batch(CHAT, "f", 86400, "24h", None, parse(text.encode(), CHAT))


def _stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP): its state in ``/proc`` is ``T``."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "T"


def _answer(store: Store, lines: list[Line], by: str) -> int:
    outcomes = [Outcome(ln, "done", response=json.dumps({"by": by}), tokens=1) for ln in lines]
    while True:
        try:
            return store.record(outcomes)
        except StoreUnavailable:
            continue


def _feed_until(store: Store, want: int, taken: list[Line]) -> None:
    """The other feeder: claims and answers until it has taken ``want`` lines (a claim the store reports unavailable
    is made again, as the feeder does)."""
    while len(taken) < want:
        try:
            got = store.claim(100, "other")
        except StoreUnavailable:
            continue
        if got:
            assert _answer(store, got, "other") == len(got)
            taken.extend(got)


@pytest.mark.postgresql
@pytest.mark.parametrize("where", ["claim", "record"])
def test_a_feeder_frozen_inside_its_transaction_holds_no_other_feeder_up(server, procs, where):
    """Was: a feeder stopped inside a claim locked every open batch until it was continued. Two batches of 30; a
    feeder process claims 10 and stops itself inside the ``where`` transaction; the other feeder claims and answers
    everything left (all 60 when the frozen claim is ended by the server, else the 50 it never claimed)."""
    from agent_support import eventually

    store = _store(server.database(f"frozen_{where}_{os.getpid()}_{time.monotonic_ns()}"))
    try:
        ids = [_batch(store, 30, "a"), _batch(store, 30, "b")]
        frozen = subprocess.Popen([sys.executable, str(FROZEN), store.engine.pool.conninfo, where, "frozen", "10"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(frozen)
        assert frozen.stdout.readline().strip() == "stopping", frozen.stderr.read()  # type: ignore[union-attr]
        eventually(lambda: _stopped(frozen.pid), what="the feeder stopped inside its transaction")
        taken: list[Line] = []
        other = threading.Thread(target=_feed_until, args=(store, 60 if where == "claim" else 50, taken), daemon=True)
        other.start()
        other.join(120)
        assert not other.is_alive(), f"the other feeder was held up by the frozen one: {len(taken)} line(s) taken"
        os.kill(frozen.pid, signal.SIGCONT)
        out, err = frozen.communicate(timeout=120)
        assert frozen.returncode == 0, err
        result = json.loads(out.splitlines()[-1])
        assert result["unavailable"] >= 1, "its connection was ended by the server while it was stopped"
        assert len(result["claimed"]) == (0 if where == "claim" else 10) == result["recorded"]
        for bid in ids:
            row = store.batch(bid)
            assert (row["status"], row["queued"], row["inflight"], row["done"]) == ("completed", 0, 0, 30)
            answers = list(store.results(bid, "done"))
            assert sorted(r["idx"] for r in answers) == list(range(30)), "every line answered once"
        by = [json.loads(r["response"])["by"] for bid in ids for r in store.results(bid, "done")]
        assert by.count("frozen") == len(result["claimed"]) and by.count("other") == len(taken)
    finally:
        store.close()


def _server_processes(pg: Postgres) -> list[int]:
    """The postmaster and every process it started (its backends, checkpointer, ...)."""
    main = pg.postmaster_pid()
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2:].split()[1]) == main:
            children.append(int(stat.parent.name))
    return [main, *children]


@pytest.mark.postgresql
def test_the_api_answers_503_while_its_database_server_is_stopped(tmp_path, procs):
    """Was: with the server stopped, a GET waited 34 s and more on a pooled connection's check. Every request now
    ends within its bound (``timeslice.batch.postgresql``) with a 503 in OpenAI's shape, and once the server is
    continued the API answers again."""
    from agent_support import eventually
    from batch_support import BatchServiceProc, create_batch, write_requests

    need_postgres()
    pg = Postgres().start()
    try:
        env = {"TIMESLICE_BATCH_DSN": pg.database("stopped"), "TIMESLICE_BATCH_API_KEY": "k" * 32}
        api = BatchServiceProc(tmp_path / "api", "", command=("serve", "--api-only"), env=env,
                               extra=("timeslice.batch.store=postgresql",)).start()
        procs.append(api)
        write_requests(tmp_path / "in.jsonl", 3)
        with api.http(timeout=120) as http:
            bid = create_batch(http, tmp_path / "in.jsonl")
            paths = [f"/v1/batches/{bid}", "/v1/batches", "/v1/files", f"/timeslice/batches/{bid}"]
            stopped = _server_processes(pg)
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            try:
                with ThreadPoolExecutor(len(paths)) as pool:
                    answers = list(pool.map(http.get, paths))
            finally:
                for pid in stopped:
                    os.kill(pid, signal.SIGCONT)
            for path, resp in zip(paths, answers):
                assert resp.status_code == 503, (path, resp.text)
                error = resp.json()["error"]
                assert error["code"] == "storage_unavailable" and error["type"] == "invalid_request_error", error
            eventually(lambda: http.get(f"/v1/batches/{bid}").status_code == 200, what="the API answering again")
    finally:
        pg.close()
