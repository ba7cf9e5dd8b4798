"""Each batch's ETA as the API shows it: the pure estimate (:mod:`~timeslice_verl.batch.eta`) over the open batches
as the database holds them, on the database's clock, at the speed the service measured.

The batch object carries it in one extension field, ``timeslice_eta`` (OpenAI's fields stay as they are)::

    "timeslice_eta": {"eta_at": 1767000000, "eta_s": 412.5, "basis": "tokens", "late": false, "why": null}

``eta_at``: when the batch should end (epoch seconds, as the ``*_at`` fields); ``eta_s``: seconds from now;
``basis``: what the figure rests on (:class:`~timeslice_verl.batch.eta.Basis`); ``late``: the ETA is past the end of
its ``completion_window`` (None: no estimate); ``why``: what a ``late`` or a missing ETA means, in words. At
creation a late batch is made all the same, flagged, unless its owner's key policy says ``refuse_late=true``: then
the request is refused (400, ``completion_window_too_short``) and nothing is made.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from timeslice_verl.batch.eta import WINDOW_S, Basis, Rate, Work, asked_per_line, estimate, late
from timeslice_verl.batch.lines import BatchRefused
from timeslice_verl.batch.status import OPEN
from timeslice_verl.batch.store import Store

ETA_FIELD = "timeslice_eta"
"""The batch object's extension field (beside ``timeslice_usage``: :mod:`~timeslice_verl.batch.usage`)."""
COLD = (f"no measurement yet: the service has not answered lines with its gate open long enough in the last "
        f"{WINDOW_S / 60:.0f} min to estimate; nothing is flagged late until it has")


class Estimates:
    """ETAs of the batches of ``store`` at the speed ``rate`` gives (None: not measured), each owner's weight from
    ``weight``."""

    def __init__(self, store: Store, rate: Callable[[], Rate | None],
                 weight: Callable[[str], float] = lambda owner: 1.0) -> None:
        self.store, self.rate, self.weight = store, rate, weight

    def table(self, role: str, extra: Work | None = None) -> tuple[float, dict[str, float], Rate | None]:
        """The database's clock now, the seconds until each open batch of ``role`` ends (``extra``: one more, a
        batch being created), and the rate they rest on."""
        rows = self.store.query(self.store.dialect.sql("eta_open"), (role,))
        now = float(rows[0]["now"]) if rows else float(self.store.query(self.store.dialect.sql("clock"))[0]["now"])
        work = [Work(r["id"], r["priority"], r["owner"], r["seq"], float(r["expires_at"]), r["queued"] + r["inflight"],
                     r["done"], r["tokens"], self.weight(r["owner"]), asked_per_line(r["asked_tokens"], r["asked_lines"]))
                for r in rows]
        rate = self.rate()
        return now, estimate(work + ([extra] if extra else []), rate), rate

    def field(self, row: dict[str, Any], table: tuple[float, dict[str, float], Rate | None] | None = None) -> dict:
        """The ``timeslice_eta`` field of the batch ``row`` (``table``: :meth:`table` for its role, if already read)."""
        if row["status"] not in OPEN:
            return shown(None, Basis.ended, 0.0, row)
        now, etas, rate = table or self.table(row["tenant_role"])
        if rate is None:
            return shown(None, Basis.cold, now, row)
        return shown(etas.get(row["id"]), rate.basis, now, row)

    def fields(self, rows: list[dict[str, Any]]) -> dict[str, dict]:
        """The ``timeslice_eta`` field of each of ``rows``, the open batches read once per tenant role."""
        tables = {r["tenant_role"]: self.table(r["tenant_role"]) for r in rows if r["status"] in OPEN}
        return {r["id"]: self.field(r, tables.get(r["tenant_role"])) for r in rows}

    def admit(self, refuse_late: bool) -> Callable[[str, int], None]:
        """The check of a batch being created (:meth:`Store.create_batch`'s ``admit``): refuses it (a
        :class:`BatchRefused`) when its ETA, the work ahead of it counted, is past its window and ``refuse_late``."""

        def check(bid: str, total: int) -> None:
            if not refuse_late:
                return
            row = self.store.batch(bid) or {}
            new = Work(bid, row["priority"], row["owner"], row["seq"], float(row["expires_at"]), total,
                       weight=self.weight(row["owner"]), asked=asked_per_line(row["asked_tokens"], row["asked_lines"]))
            now, etas, rate = self.table(row["tenant_role"], new)
            got = shown(etas.get(bid), rate.basis if rate else Basis.cold, now, row)
            if got["late"]:
                raise BatchRefused(f"completion_window {row['completion_window']!r} ends in "
                                   f"{row['expires_at'] - now:.0f} s, but at the speed measured here this batch of "
                                   f"{total} lines, the work ahead of it counted, should end in {got['eta_s']:.0f} s "
                                   "(its owner's key policy says refuse_late=true): give a longer window, or fewer "
                                   "lines", "completion_window", "completion_window_too_short")
        return check


def shown(eta_s: float | None, basis: Basis, now: float, row: dict[str, Any]) -> dict[str, Any]:
    """The ``timeslice_eta`` field: the ETA, what it rests on, whether it is past the window, and why, in words."""
    if basis is Basis.ended:
        return {"eta_at": None, "eta_s": None, "basis": str(basis), "late": None, "why": None}
    if basis is Basis.cold or eta_s is None or not math.isfinite(eta_s):
        return {"eta_at": None, "eta_s": None, "basis": str(Basis.cold), "late": None, "why": COLD}
    deadline = float(row["expires_at"])
    missed = bool(late(eta_s, now, deadline))
    why = (f"its ETA ({eta_s:.0f} s from now, at the speed measured here with the work ahead of it counted) is past "
           f"the end of its completion_window {row['completion_window']!r} ({deadline - now:.0f} s from now): lines "
           "not sent by then end expired") if missed else None
    return {"eta_at": int(math.ceil(now + eta_s)), "eta_s": round(eta_s, 1), "basis": str(basis), "late": missed,
            "why": why}


__all__ = ["COLD", "ETA_FIELD", "Estimates", "shown"]
