"""A recorded run of ``benchmarks/eta.py`` put through the ETA's estimate again, offline: each poll's open batches as
the run read them, at the speed the service measured then, through :func:`timeslice_verl.batch.eta.estimate` as the
checkout has it — a variant of the estimator judged on the same valleys and batches in seconds, not in a new run of
30 minutes (whose valleys and batches come out the same only up to the machine's timing).

    python benchmarks/eta_replay.py eta/2026-12-06-cpu-b --out build/replay [--share-window 120] [--no-prior]

What a run recorded stands in for what the service knew: a batch's lines and ``max_tokens`` (every line of a batch
of this benchmark asks the same), its answered lines and tokens at each reading (runs recorded before the tokens
were: the stand-in writes every answer to its limit, so answered lines times ``max_tokens``), the speed of the
service's ``/timeslice/summary`` read right after (before its generated-per-asked share was recorded: 1, the
stand-in's). ``--share-window S``: the valley share from the run's own gate log over the last S seconds instead of
the service's; ``--known-valleys``: the gate's real future (what no estimate knows), the error that is left without the
valleys' chance. The replayed readings go to ``--out`` beside the run's batches; the tables are the reader's.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from readers.common import Run, jsonl, open_run
from readers.eta import points, summary_line
from timeslice_verl.batch.eta import Rate, Work, estimate

WEIGHTS = (1.0, 2.0)
"""The two owners' weights, as ``benchmarks/eta.py``'s key file gives them (a batch's ``owner`` is the index)."""


def rounds(data: Path) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each poll of the run: the service's speed read at its end, and the readings of every open batch before it."""
    readings, out, i = jsonl(data / "observations.jsonl"), [], 0
    for speed in jsonl(data / "speed.jsonl"):
        taken = []
        while i < len(readings) and readings[i]["at"] <= speed["at"]:
            taken.append(readings[i])
            i += 1
        out.append((speed, taken))
    return out


def open_share(gate: list[dict[str, Any]], at: float, window_s: float) -> float | None:
    """The share of the last ``window_s`` before ``at`` the run's gate log says was open (None: no log yet)."""
    start = max(gate[0]["at"], at - window_s) if gate else at
    if at <= start:
        return None
    opened = 0.0
    for this, following in zip(gate, gate[1:] + [{"at": at}]):
        if this["open"]:
            opened += max(0.0, min(at, following["at"]) - max(start, this["at"]))
    return opened / (at - start)


def wall_s(gate: list[dict[str, Any]], at: float, open_s: float) -> float:
    """Wall seconds from ``at`` until the run's gate has been open ``open_s`` seconds more (its log's real future)."""
    done = 0.0
    for this, following in zip(gate, gate[1:] + [{"at": float("inf")}]):
        start = max(at, this["at"])
        if this["open"] and following["at"] > start:
            if done + following["at"] - start >= open_s:
                return start + open_s - done - at
            done += following["at"] - start
    return float("inf")


def rate_of(speed: dict[str, Any], gate: list[dict[str, Any]], share_window: float | None) -> Rate | None:
    """The speed the service measured at this poll (None: it had none), its valley share from the gate log if asked."""
    got = speed.get("speed")
    if not got:
        return None
    share = open_share(gate, speed["at"], share_window) if share_window else None
    per_line = got["tokens_per_open_s"] / got["lines_per_open_s"] if got["lines_per_open_s"] > 0 else None
    return Rate(got["tokens_per_open_s"], got["lines_per_open_s"], got["open_share"] if share is None else share,
                per_line, got["window_s"], got.get("fill", 1.0))


def work_of(reading: dict[str, Any], batch: dict[str, Any], seq: int, prior: bool) -> Work:
    """The estimate's view of one batch at one reading."""
    done = reading["completed"]
    tokens = reading.get("tokens")
    return Work(reading["id"], batch["priority"], str(batch["owner"]), seq, float(batch.get("expires_at") or 1e12),
                reading["total"] - done - reading["failed"], done,
                done * batch["max_tokens"] if tokens is None else tokens, WEIGHTS[batch["owner"]],
                float(batch["max_tokens"]) if prior else None)


def replay(data: Path, out: Path, share_window: float | None = None, prior: bool = True,
           known_valleys: bool = False) -> Path:
    """The run's readings with the replayed ETAs, written to ``out`` beside its batches (the reader's input);
    ``known_valleys``: each batch's open seconds left turned into wall seconds by the gate's real future."""
    batches = {b["id"]: b for b in jsonl(data / "batches.jsonl")}
    gate, seqs, rows = jsonl(data / "gate.jsonl"), {}, []
    for speed, readings in rounds(data):
        for r in readings:
            seqs.setdefault(r["id"], len(seqs))
        live = [r for r in readings if r["status"] == "in_progress" and r["id"] in batches]
        rate = rate_of(speed, gate, share_window)
        if known_valleys and rate is not None:
            rate = replace(rate, open_share=1.0)
        etas = estimate([work_of(r, batches[r["id"]], seqs[r["id"]], prior) for r in live], rate)
        if known_valleys:
            etas = {k: wall_s(gate, speed["at"], v) for k, v in etas.items()}
        for r in readings:
            eta = etas.get(r["id"]) if r["status"] == "in_progress" else None
            rows.append({**r, "eta_s": eta, "eta_at": None if eta is None else r["at"] + eta})
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(data / "batches.jsonl", out / "batches.jsonl")
    (out / "observations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a run's folder, or EXPERIMENT/RUN under benchmarks/results, or a folder of raw data")
    ap.add_argument("--out", type=Path, required=True, help="where the replayed readings go")
    ap.add_argument("--share-window", type=float, default=None, metavar="S",
                    help="the valley share over the last S seconds of the run's gate log (default: the service's)")
    ap.add_argument("--no-prior", action="store_true", help="leave out what the lines ask for (max_tokens)")
    ap.add_argument("--known-valleys", action="store_true",
                    help="the gate's real future instead of its share: the error left without the valleys' chance")
    args = ap.parse_args()
    raw = Path(args.run)
    data = raw if (raw / "observations.jsonl").exists() else open_run(args.run).data
    out = replay(data, args.out, args.share_window, not args.no_prior, args.known_valleys)
    print(summary_line(out))
    print(points(Run(out, {}, out)))


if __name__ == "__main__":
    main()
