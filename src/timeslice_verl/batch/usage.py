"""Who got what from the valleys: each batch's and each owner's tokens in and out, valley GPU-seconds, tries a yield
cut and waits; and each tenant's valley seconds per hour — lent (the gate open), used (lines in flight) and wasted
(the gate open, nothing in flight).

**GPU-seconds are shared pro rata among the lines in flight at each moment**, not by tokens: while the gate is open
and ``n`` lines are in flight, each receives ``dt / n`` of every ``dt``. vLLM runs every request in flight in one
step, each taking a slot of the running batch (its KV cache, one token per step), so a line holds its share of the
GPU for as long as it is in flight — the prefill of a long prompt, the wait in vLLM's queue and a try a yield cut
(whose tokens no answer reports) included, which a share by completion tokens would give to others. The shares sum
to the seconds the gate was open with a line in flight (``used``): each interval ``dt`` is given out whole. Kept as a
running sum of ``dt / n`` (:class:`Valley`): a line's seconds are the sum's growth from its send to its end, O(1)
per line. The seconds a feeder measured go to the database with its next write (``batches.gpu_s`` and the owner's
minute in ``gpu_usage``, which ``gpu_seconds_per_day`` reads), whatever became of the answers; a feeder stopped
with lines in flight takes their seconds with it (as its node's figures, which live in its memory). The seconds
given out between two looks go to the hour of the second look (a look at every send and end, and status and scrape).

Tokens are the answers' ``usage`` (``prompt_tokens``: the batch's ``input_tokens``; ``completion_tokens``: its
``output_tokens``), counted once per line answered. Waits, on the database's clock: a batch's queue wait is its
creation to its first line taken for sending; a line's wait, its batch's creation to its first taking (summed per
batch, and the mean over the lines taken).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping

FIELD = "timeslice_usage"
"""The batch object's extension field with the figures OpenAI's ``usage`` has no place for."""
OTHER = "(unconfigured)"
"""The metrics' ``owner`` label of the owners no key names now (a removed key's, a plain key's): labels stay bounded
by the key file."""
HOURS = 24
"""Hours of valley seconds kept (in memory: the node's own figures, since the service started)."""
USES = ("lent", "used", "wasted")


@dataclass
class Valley:
    """One tenant's valley seconds (``seconds_open``: its gate's open seconds, which stop while the trainer has the
    GPU) and the pro rata share of them each line in flight receives."""

    seconds_open: Callable[[], float]
    clock: Callable[[], float] = time.time
    """Only to label the hours (this node's figures)."""
    lent: float = 0.0
    used: float = 0.0
    wasted: float = 0.0
    hours: dict[int, list[float]] = field(default_factory=dict)
    """Hour's start (epoch seconds) → ``[lent, used, wasted]``, the last :data:`HOURS`."""
    _seen: float = 0.0
    _share: float = 0.0
    _started: dict[Hashable, float] = field(default_factory=dict)
    _spent: dict[tuple[str, str], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    """The feeder's loop sends and ends; the status and the metrics read from the API's threads."""

    def advance(self) -> None:
        """Give out the open seconds since the last look: to the lines in flight, else wasted."""
        with self._lock:
            self._advance()

    def _advance(self) -> None:
        now = self.seconds_open()
        dt, self._seen = now - self._seen, now
        if dt <= 0:
            return
        hour = int(self.clock() // 3600 * 3600)
        bucket = self.hours.setdefault(hour, [0.0, 0.0, 0.0])
        if len(self.hours) > HOURS:
            del self.hours[min(self.hours)]
        n = len(self._started)
        self.lent += dt
        bucket[0] += dt
        if n:
            self._share += dt / n
            self.used += dt
            bucket[1] += dt
        else:
            self.wasted += dt
            bucket[2] += dt

    def start(self, send: Hashable) -> float:
        """A line was sent (``send``: what names this try until it ends); the gate's open seconds now."""
        with self._lock:
            self._advance()
            self._started[send] = self._share
            return self._seen

    def end(self, send: Hashable, batch_id: str, owner: str) -> float:
        """The try ``send`` ended (answered, cut, failed or cancelled): its share goes to its batch and owner; the
        gate's open seconds now (the answer's time is taken on the same reading)."""
        with self._lock:
            self._advance()
            seconds = self._share - self._started.pop(send)
            key = (batch_id, owner)
            self._spent[key] = self._spent.get(key, 0.0) + seconds
            return self._seen

    def take(self) -> dict[tuple[str, str], float]:
        """The seconds given out since the last take, by ``(batch, owner)``: the writer's next transaction adds them."""
        with self._lock:
            out, self._spent = self._spent, {}
        return out

    def figures(self) -> dict[str, Any]:
        with self._lock:
            self._advance()
            hours = sorted((h, list(b)) for h, b in self.hours.items())
        return {"lent_s": round(self.lent, 3), "used_s": round(self.used, 3), "wasted_s": round(self.wasted, 3),
                "hours": [{"hour": h, **{f"{u}_s": round(v, 3) for u, v in zip(USES, b)}}
                          for h, b in hours]}


def node_figures(valleys: Iterable[Valley]) -> dict[str, Any]:
    """The node's valley seconds: its tenants' summed, in all and per hour (epoch seconds of the hour's start)."""
    total = dict.fromkeys(("lent_s", "used_s", "wasted_s"), 0.0)
    hours: dict[int, dict[str, float]] = {}
    for v in valleys:
        f = v.figures()
        for k in total:
            total[k] += f[k]
        for h in f["hours"]:
            into = hours.setdefault(h["hour"], dict.fromkeys(total, 0.0))
            for k in total:
                into[k] += h[k]
    return {**{k: round(x, 3) for k, x in total.items()},
            "hours": [{"hour": h, **{k: round(x, 3) for k, x in v.items()}} for h, v in sorted(hours.items())]}


def usage_object(row: Mapping[str, Any]) -> dict[str, Any]:
    """A batch's ``usage`` as OpenAI's batch object has it: the tokens of its lines answered (vLLM reports neither
    cached nor reasoning tokens apart: 0)."""
    inp, out = int(row.get("prompt_tokens") or 0), int(row.get("tokens") or 0)
    return {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out,
            "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}


def extension(row: Mapping[str, Any]) -> dict[str, Any]:
    """A batch's figures OpenAI's ``usage`` has no place for (:data:`FIELD`)."""
    first = row.get("first_sent_at")
    sent = int(row.get("sent_lines") or 0)
    wait = float(row.get("wait_s") or 0.0)
    return {"gpu_seconds": round(float(row.get("gpu_s") or 0.0), 3), "cut_tries": int(row.get("cuts") or 0),
            "queue_wait_s": None if first is None else round(max(0.0, float(first) - row["created_at"]), 3),
            "lines_sent": sent, "line_wait_s": {"total": round(wait, 3), "mean": round(wait / sent, 3) if sent else None}}


def owners(store: Any) -> list[dict[str, Any]]:
    """Every owner's batches summed, with its valley GPU-seconds over the last day (the quota's figure)."""
    sql = store.dialect.sql
    day = {r["owner"]: float(r["gpu_s"]) for r in store.query(sql("owners_gpu_day"))}
    out = []
    for r in store.query(sql("owners_attribution")):
        inp, outp, sent = int(r["input_tokens"]), int(r["output_tokens"]), int(r["sent_lines"])
        out.append({"owner": r["owner"], "batches": int(r["batches"]), "input_tokens": inp, "output_tokens": outp,
                    "total_tokens": inp + outp, "gpu_seconds": round(float(r["gpu_s"]), 3),
                    "gpu_seconds_last_day": round(day.get(r["owner"], 0.0), 3), "cut_tries": int(r["cuts"]),
                    "queue_wait_s": round(float(r["queue_wait_s"]), 3), "lines_sent": sent,
                    "line_wait_s": round(float(r["line_wait_s"]), 3)})
    return out


def by_label(rows: list[dict[str, Any]], configured: set[str]) -> dict[str, dict[str, float]]:
    """``owners`` rows folded by the metrics' ``owner`` label: a configured owner its own, every other :data:`OTHER`."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        into = out.setdefault(r["owner"] if r["owner"] in configured else OTHER, {})
        for k, v in r.items():
            if k != "owner":
                into[k] = into.get(k, 0) + v
    return out


OWNER_METRICS = (("input_tokens", "input_tokens", "Prompt tokens of the owner's lines answered"),
                 ("output_tokens", "output_tokens", "Completion tokens of the owner's lines answered"),
                 ("gpu_seconds", "gpu_seconds", "Valley GPU-seconds the owner's lines received (shared pro rata among "
                                                "the lines in flight)"),
                 ("cut_tries", "cut_tries", "Tries of the owner's lines a yield cut (resumed ones included)"),
                 ("queue_wait_seconds", "queue_wait_s", "Seconds from each of the owner's batches' creation to its "
                                                        "first line sent"),
                 ("line_wait_seconds", "line_wait_s", "Seconds from the owner's lines' batch creation to each line's "
                                                      "first send"))
"""The owner's counters: the metric's name, the figure of :func:`owners`, the help."""


def collect(service: Any) -> Iterator[Any]:
    """The Prometheus families of the attribution (labelled by configured ``owner``, the rest :data:`OTHER`: never
    by batch) and of the node's valley seconds (by ``tenant`` and ``use``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    configured = {k.owner for k in service.keys.keys()}
    folded = by_label(owners(service.store), configured)
    for name, key, help_ in OWNER_METRICS:
        family = CounterMetricFamily(f"timeslice_batch_owner_{name}", help_, labels=["owner"])
        for owner, figures in sorted(folded.items()):
            family.add_metric([owner], figures[key])
        yield family
    day = GaugeMetricFamily("timeslice_batch_owner_gpu_seconds_last_day", "Valley GPU-seconds the owner's lines "
                            "received over the last day (what gpu_seconds_per_day holds)", labels=["owner"])
    for owner, figures in sorted(folded.items()):
        day.add_metric([owner], figures["gpu_seconds_last_day"])
    yield day
    valley = CounterMetricFamily("timeslice_batch_valley_seconds", "Seconds the tenant had the GPU: lent (the gate "
                                 "open), used (lines in flight), wasted (the gate open, nothing in flight)",
                                 labels=["tenant", "use"])
    for feeder in service.feeders:
        figures = feeder.valley.figures()
        for use in USES:
            valley.add_metric([feeder.url, use], figures[f"{use}_s"])
    yield valley


__all__ = ["FIELD", "HOURS", "OTHER", "USES", "Valley", "by_label", "collect", "extension", "node_figures", "owners",
           "usage_object"]
