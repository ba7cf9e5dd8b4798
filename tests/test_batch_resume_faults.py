"""A line a yield cut, its feeder gone at each point of what follows, on SQLite and a real PostgreSQL server: before
the kept output is stored, while the continued request runs, and before its answer is stored (the points between
— after storing, and a lease taken over — are in ``test_batch_resume.py``). Each time the service that comes back
(``recover``, as at its start) delivers the line once and whole, and the stand-in's count of generated tokens says
exactly what was generated again."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest

from agent_support import FakeVllmProc, eventually
from pg_support import server, store_fixture  # noqa: F401 (server: a fixture)
from test_batch_resume import BUDGET, _answer, _batch, _cut, _feed, _row, _whole
from timeslice_verl.batch.claims import Outcome
from timeslice_verl.batch.feeder import Feeder

store = store_fixture("resume_faults")


class Dying:
    """The store as a feeder sees it until it dies: the write of an outcome ``when`` picks never lands (the feeder is
    gone inside it); every other call is the store's own."""

    def __init__(self, store: Any, when: Callable[[Outcome], bool]) -> None:
        self.store, self.when = store, when
        self.hit, self.gone = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def record(self, outcomes: list[Outcome], *rest: Any) -> int:
        if any(self.when(o) for o in outcomes):
            self.hit.set()
            self.gone.wait(120)
            return 0
        return self.store.record(outcomes, *rest)


def _back(store: Any, tenant: FakeVllmProc, bid: str) -> dict[str, Any]:
    """The service started again: what was in flight back in the queue, a new feeder, the line's one answer."""
    assert store.recover(everything=True) >= 1, "the line was in flight when its feeder went"
    _feed(store, tenant, lambda f: eventually(lambda: store.batch(bid)["status"] == "completed", what="completed"))
    return _answer(store, bid)


def test_gone_before_the_kept_output_is_stored_the_line_starts_again(store, procs):
    tenant = FakeVllmProc("--token-s", "0.005")
    procs.append(tenant)
    bid, kept = _batch(store), [0]
    dying = Dying(store, lambda o: o.state == "queued" and o.partial is not None)

    def first(feeder: Feeder) -> None:
        eventually(lambda: tenant.stats()["running"] == 1 and tenant.stats()["generated"] > 20, what="generating")
        tenant.post("/pause?mode=abort")
        assert dying.hit.wait(60), "the cut answer came back to be stored"
        kept[0] = tenant.stats()["generated"]
        dying.gone.set()

    _feed(dying, tenant, first)  # type: ignore[arg-type]
    tenant.post("/resume")
    assert _row(store)["partial"] is None, "nothing of the cut was stored"
    _whole(_back(store, tenant, bid), "req-0")
    assert tenant.stats()["generated"] == kept[0] + BUDGET, "started again: what the cut try made, made again"


def test_gone_while_the_continued_request_runs_the_line_goes_on_from_what_was_stored(store, procs):
    tenant = FakeVllmProc("--token-s", "0.005")
    procs.append(tenant)
    bid, kept, lost = _batch(store), [0], [0]

    def first(feeder: Feeder) -> None:
        kept[0] = _cut(store, tenant, 20)
        tenant.post("/resume")
        eventually(lambda: tenant.stats()["running"] == 1 and tenant.stats()["generated"] > kept[0] + 20,
                   what="the continued request generating")

    _feed(store, tenant, first)  # the feeder's task ends: its connections close, the stand-in stops the request
    eventually(lambda: tenant.stats()["running"] == 0, what="the stand-in dropped the request its client left")
    lost[0] = tenant.stats()["generated"] - kept[0]
    _whole(_back(store, tenant, bid), "req-0")
    assert tenant.stats()["generated"] == BUDGET + lost[0], "only the gone try's tokens were made again"


@pytest.mark.parametrize("cuts", [1, 2])
def test_gone_before_the_answer_is_stored_the_line_goes_on_again_from_what_was_stored(store, procs, cuts):
    tenant = FakeVllmProc("--token-s", "0.005")
    procs.append(tenant)
    bid, kept = _batch(store), [0]
    dying = Dying(store, lambda o: o.state == "done")

    def first(feeder: Feeder) -> None:
        for _ in range(cuts):
            kept[0] = _cut(store, tenant, kept[0] + 20)
            tenant.post("/resume")
        assert dying.hit.wait(60), "the continued request answered"
        dying.gone.set()

    _feed(dying, tenant, first)  # type: ignore[arg-type]
    assert _row(store)["partial"] is not None, "what the cuts kept is still the line's"
    _whole(_back(store, tenant, bid), "req-0")
    assert tenant.stats()["generated"] == kept[0] + 2 * (BUDGET - kept[0]), "the lost answer's part, made again"
