"""A line a yield cut keeps what it generated and goes on from it in the next valley, answered once, on SQLite and a
real PostgreSQL server: cut several times mid-answer, its feeder gone between storing the kept output and the next
send, its claim taken over by another feeder after the holder's lease ran out, its continued request refused. The
tenant is the stand-in vLLM, which answers an abort as vLLM 0.24 does (the text and usage generated so far); its count
of generated tokens tells what was generated again."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

import pytest

from agent_support import FakeVllmProc, eventually
from pg_support import server, store_fixture  # noqa: F401 (server: a fixture)
from timeslice_verl.batch.claims import Outcome
from timeslice_verl.batch.concurrency import Policy
from timeslice_verl.batch.feeder import Feeder
from timeslice_verl.batch.gate import Gate
from timeslice_verl.batch.lines import parse
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

store = store_fixture("resume")
BUDGET = 400
"""Each line's max_tokens: the stand-in generates 4 tokens a 20 ms tick, so a line takes 2 s unless cut."""


def _batch(store: Any, endpoint: str = COMPLETIONS, prompt: Any = "req-0") -> str:
    body: dict[str, Any] = {"model": "m", "max_tokens": BUDGET}
    body.update({"messages": [{"role": "user", "content": prompt}]} if endpoint == CHAT else {"prompt": prompt})
    line = json.dumps({"custom_id": "req-0", "method": "POST", "url": endpoint, "body": body})
    return store.create_batch(endpoint, "f", 86400, "24h", None, parse(line.encode(), endpoint))


def _row(store: Any) -> dict[str, Any]:
    return dict(store.query("SELECT state, attempts, partial FROM lines")[0])


def _feed(store: Any, tenant: FakeVllmProc, script: Callable[[Feeder], None], **kwargs: Any) -> Feeder:
    """A feeder on ``store`` while ``script`` (in a thread) drives the tenant; the feeder once it ends."""

    async def main() -> Feeder:
        feeder = Feeder(store, tenant.url, Gate(None, poll_s=0.05), policy=Policy(start=4), adapt=False, **kwargs)
        task = asyncio.create_task(feeder.run())
        try:
            await asyncio.to_thread(script, feeder)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return feeder

    return asyncio.run(main())


def _cut(store: Any, tenant: FakeVllmProc, more_than: int) -> int:
    """Once the tenant generated more than ``more_than`` tokens, the ladder's abort; then its kept output stored with
    the line, queued again. The tokens kept."""
    eventually(lambda: tenant.stats()["running"] == 1 and tenant.stats()["generated"] > more_than, what="generating")
    tenant.post("/pause?mode=abort")
    row = eventually(lambda: (r := _row(store))["state"] == "queued" and r["partial"] and r, what="the kept output stored")
    kept = json.loads(row["partial"])
    assert kept["tokens"] == tenant.stats()["generated"] and kept["text"].endswith("x" * kept["tokens"])
    assert row["attempts"] == 0, "a try that kept tokens is not counted"
    return kept["tokens"]


def _answer(store: Any, bid: str) -> dict[str, Any]:
    eventually(lambda: store.batch(bid)["status"] == "completed", what="the batch completed")
    rows = list(store.results(bid, "done"))
    assert [r["custom_id"] for r in rows] == ["req-0"], "answered once"
    assert _row(store)["partial"] is None, "what was kept goes with the answer"
    return json.loads(rows[0]["response"])["body"]


def _text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _whole(answer: dict[str, Any], prompt: Any) -> None:
    """One completion, as a line never cut is answered: its text whole, its usage the original prompt's and the
    whole budget's (the stand-in echoes a prompt of ids as the list's text, one token an id)."""
    assert _text(answer) == f"echo:{prompt}|" + "x" * BUDGET
    assert answer["choices"][0]["finish_reason"] == "length"
    prompt_tokens = 1 if isinstance(prompt, str) else len(prompt)
    assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": BUDGET,
                               "total_tokens": BUDGET + prompt_tokens}


def test_a_line_cut_several_times_goes_on_each_time_and_nothing_is_generated_twice(store, procs):
    tenant = FakeVllmProc("--token-s", "0.005")
    procs.append(tenant)
    bid = _batch(store)
    kept: list[int] = []

    def script(feeder: Feeder) -> None:
        for _ in range(3):
            kept.append(_cut(store, tenant, kept[-1] + 20 if kept else 20))
            tenant.post("/resume")
        eventually(lambda: store.batch(bid)["status"] == "completed", what="the batch completed")

    feeder = _feed(store, tenant, script)
    _whole(_answer(store, bid), "req-0")
    assert tenant.stats()["generated"] == BUDGET, "the kept tokens were not generated again"
    assert tenant.stats()["aborted"] == 3 and kept == sorted(set(kept))
    assert (feeder.stats.resumed, feeder.stats.kept) == (3, BUDGET - (BUDGET - kept[-1]))
    assert store.figures(bid)["tokens"] == BUDGET
    row = store.batch(bid)
    assert row["cuts"] == 3, "each try a yield cut is counted, resumed ones too"
    assert row["prompt_tokens"] == _answer(store, bid)["usage"]["prompt_tokens"] > 0
    assert row["gpu_s"] == pytest.approx(feeder.valley.used) and row["gpu_s"] > 0, "one line: every second used is its"


@pytest.mark.parametrize("endpoint, prompt", [(CHAT, "req-0"), (COMPLETIONS, [7, 8, 9])], ids=["chat", "token ids"])
def test_a_chat_and_a_prompt_of_token_ids_go_on_from_their_kept_output(store, procs, endpoint, prompt):
    tenant = FakeVllmProc("--token-s", "0.005")
    procs.append(tenant)
    bid = _batch(store, endpoint, prompt)

    def script(feeder: Feeder) -> None:
        _cut(store, tenant, 20)
        tenant.post("/resume")
        eventually(lambda: store.batch(bid)["status"] == "completed", what="the batch completed")

    _feed(store, tenant, script)
    answer = _answer(store, bid)
    _whole(answer, prompt)
    assert "token_ids" not in answer["choices"][0], "ids asked for the resume alone are not the user's"
    assert tenant.stats()["generated"] == BUDGET


def test_a_feeder_gone_after_storing_the_kept_output_leaves_the_next_one_to_go_on(store, procs):
    """The feeder stops between the transaction that stored the kept output and the next send (it claims nothing
    more, then is cancelled, as a killed service leaves it); the next service's feeder goes on from the store."""
    tenant = FakeVllmProc("--token-s", "0.005")
    procs.append(tenant)
    bid = _batch(store)
    gone = [False]

    class Stopping:
        """The store as the first feeder sees it: after the cut, its claims take nothing."""

        def __getattr__(self, name: str) -> Any:
            attr = getattr(store, name)
            return (lambda *a, **k: []) if name == "claim" and gone[0] else attr

    def first(feeder: Feeder) -> None:
        eventually(lambda: tenant.stats()["running"] == 1 and tenant.stats()["generated"] > 20, what="generating")
        gone[0] = True
        _cut(store, tenant, 20)

    _feed(Stopping(), tenant, first)  # type: ignore[arg-type]
    tenant.post("/resume")
    store.recover(everything=False)  # what a service does at its start (nothing is in flight: the line is queued)
    _feed(store, tenant, lambda f: eventually(lambda: store.batch(bid)["status"] == "completed", what="completed"))
    _whole(_answer(store, bid), "req-0")
    assert tenant.stats()["generated"] == BUDGET


def test_a_lease_taken_over_goes_on_from_the_kept_output_and_the_old_holders_word_counts_for_nothing(store, procs):
    tenant = FakeVllmProc("--token-s", "0.005")
    procs.append(tenant)
    bid = _batch(store)
    cut = [False]

    class Holding:
        def __getattr__(self, name: str) -> Any:
            attr = getattr(store, name)
            return (lambda *a, **k: []) if name == "claim" and cut[0] else attr

    def first(feeder: Feeder) -> None:
        eventually(lambda: tenant.stats()["running"] == 1 and tenant.stats()["generated"] > 20, what="generating")
        cut[0] = True
        _cut(store, tenant, 20)

    _feed(Holding(), tenant, first)  # type: ignore[arg-type]
    tenant.post("/resume")
    (held,) = eventually(lambda: store.claim(1, "node-a", 0.2), what="node a claims the line")  # and freezes
    assert held.partial is not None and _row(store)["state"] == "inflight"
    eventually(lambda: store.recover(everything=False) == 1, what="node a's lease ran out on the database's clock")
    _feed(store, tenant, lambda f: eventually(lambda: store.batch(bid)["status"] == "completed", what="completed"),
          lease_s=30.0)
    # node a wakes: its cut, its answer and its failure all carry the token that was taken over
    late = [Outcome(held, "queued", partial='{"text": "stale"}'), Outcome(held, "done", response="{}", tokens=1),
            Outcome(held, "queued", restart=True)]
    assert [store.record([o]) for o in late] == [0, 0, 0]
    _whole(_answer(store, bid), "req-0")
    assert tenant.stats()["generated"] == BUDGET


def test_a_continued_request_refused_starts_the_line_again_and_it_is_answered_once(store, procs):
    tenant = FakeVllmProc("--token-s", "0.005")
    procs.append(tenant)
    bid = _batch(store)
    kept = [0]

    def script(feeder: Feeder) -> None:
        kept[0] = _cut(store, tenant, 20)
        tenant.post("/_standin/fault", {"fail": {"v1/completions": [1, "400"]}})
        tenant.post("/resume")
        eventually(lambda: store.batch(bid)["status"] == "completed", what="the batch completed")

    feeder = _feed(store, tenant, script)
    answer = _answer(store, bid)
    _whole(answer, "req-0")
    assert tenant.stats()["generated"] == kept[0] + BUDGET, "started again: the kept output dropped"
    assert feeder.stats.resumed == 1 and store.counts(bid)["failed"] == 0


def test_with_resuming_off_a_cut_line_starts_again(tmp_path, procs):
    from timeslice_verl.batch.store import Store

    tenant = FakeVllmProc("--token-s", "0.005")
    procs.append(tenant)
    own = Store(tmp_path / "off.sqlite")
    bid = _batch(own)

    def script(feeder: Feeder) -> None:
        eventually(lambda: tenant.stats()["running"] == 1 and tenant.stats()["generated"] > 20, what="generating")
        tenant.post("/pause?mode=abort")
        cut_at = tenant.stats()["generated"]
        eventually(lambda: _row(own)["state"] == "queued", what="queued again")
        assert _row(own)["partial"] is None
        tenant.post("/resume")
        eventually(lambda: own.batch(bid)["status"] == "completed", what="the batch completed")
        assert tenant.stats()["generated"] == cut_at + BUDGET

    feeder = _feed(own, tenant, script, resume_partial=False)
    _whole(_answer(own, bid), "req-0")
    assert feeder.stats.resumed == 0
    assert own.batch(bid)["cuts"] == 1, "a cut that starts again is counted too"
    own.close()
