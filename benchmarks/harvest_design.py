"""The harvest matrix's design, pure: which valley shapes the matrix runs, what each row costs, which rows are left.

Users' valleys have every shape, and the full product of the factors (4 valley lengths × 4 train phases × 3
arrival mixes × 3 completion lengths × seeds) is hundreds of rows of minutes each. A covering design keeps every
*pair* of the factors that interact most — valley × mix, valley × completion length, mix × completion length — in at
least one row: each (valley, length) cell runs twice, with two different mixes shifted cyclically by the valley's and
the length's place, so every valley meets every mix and every mix every length. The train phase goes round each
valley's rows (every valley meets every train phase: the valley's shape), the seed round all rows (each value as often
as the next). Rows are ordered by completion length: one batch input and one capacity bracket (a pass before the
length's rows and one after) per length.

``benchmarks/harvest_matrix.py`` runs it; this module holds no I/O beyond reading the row files a run left.
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

VALLEYS_S = (2.0, 4.0, 8.0, 12.0)
"""The demo's ``rollout_s``: how long the trainer waits for each batch, i.e. each valley's length."""
TRAINS_S = (0.5, 1.0, 2.0, 3.0)
"""The demo's ``train_s``: the trainer's busy phase between two valleys."""
LENGTHS = (48, 512, 2048)
"""Tokens each batch line generates (``ignore_eos``): short answers, a typical one, a long one."""
SEEDS = (0, 1, 2)
STEPS = 8
REPEATS = 2
"""Rows per (valley, completion length) cell, each with another mix."""
RUN_START_S = 30.0
"""A demo run's own start and end (agent, tenant, batch service, the tenant's warm-up), solo or time-sliced."""
LEVEL_S = 8.0
"""A capacity level's ramp up and down beside its kept-full seconds (the first wave and the last)."""
PAIRS = (("valley_s", "mix"), ("valley_s", "length"), ("mix", "length"), ("valley_s", "train_s"))
"""The factor pairs the design covers: every value of one meets every value of the other in some row."""


class Mix(enum.StrEnum):
    """How samples arrive at the trainer: :mod:`timeslice_verl.demo.arrivals`' profiles and ``even``."""

    fleet = "fleet"
    longtail = "longtail"
    even = "even"


@dataclass(frozen=True)
class MatrixRow:
    """One row: a valley shape, a mix, a completion length and a seed; solo and time-sliced, ``steps`` steps each."""

    length: int
    valley_s: float
    train_s: float
    mix: Mix
    seed: int
    steps: int = STEPS

    @property
    def name(self) -> str:
        """The row's file stem (``row-<name>.json``): its factors, so a resumed run finds it under any design order."""
        return f"{self.length}-{self.mix.value}-v{self.valley_s:g}-t{self.train_s:g}-s{self.seed}-n{self.steps}"

    def factors(self) -> dict[str, Any]:
        return asdict(self) | {"mix": self.mix.value, "name": self.name}


def design(valleys: Sequence[float] = VALLEYS_S, trains: Sequence[float] = TRAINS_S,
           mixes: Sequence[Mix] = tuple(Mix), lengths: Sequence[int] = LENGTHS, seeds: Sequence[int] = SEEDS,
           steps: int = STEPS, repeats: int = REPEATS) -> list[MatrixRow]:
    """The covering design, ordered by completion length (raises where these factors leave a pair uncovered)."""
    rows = []
    for li, length in enumerate(lengths):
        for vi, valley in enumerate(valleys):
            for k in range(repeats):
                n = len(rows)
                train = trains[(vi + repeats * li + k) % len(trains)]  # a valley's rows go round the train phases
                rows.append(MatrixRow(length=length, valley_s=float(valley), train_s=float(train),
                                      mix=Mix(mixes[(vi + li + k) % len(mixes)]), seed=seeds[n % len(seeds)], steps=steps))
    missing = uncovered(rows, {"valley_s": [float(v) for v in valleys], "mix": [Mix(m) for m in mixes],
                               "length": list(lengths), "train_s": [float(t) for t in trains]})
    if missing:
        raise ValueError(f"these factors leave pairs uncovered: {missing[:6]}")
    return rows


def rows_from(factors: Sequence[dict[str, Any]]) -> list[MatrixRow]:
    """The rows a run's ``design.json`` lists (:meth:`MatrixRow.factors`), e.g. for a reader of a recorded matrix."""
    try:
        return [MatrixRow(length=int(f["length"]), valley_s=float(f["valley_s"]), train_s=float(f["train_s"]),
                          mix=Mix(f["mix"]), seed=int(f["seed"]), steps=int(f["steps"])) for f in factors]
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"a design row lacks or mistypes a factor: {exc}") from None


def uncovered(rows: Sequence[MatrixRow], levels: dict[str, Sequence[Any]]) -> list[tuple[str, Any, str, Any]]:
    """``(factor, value, factor, value)`` for each pair of :data:`PAIRS` that no row holds."""
    out = []
    for a, b in PAIRS:
        seen = {(getattr(r, a), getattr(r, b)) for r in rows}
        out += [(a, x, b, y) for x in levels[a] for y in levels[b] if (x, y) not in seen]
    return out


def reduced(rows: Sequence[MatrixRow], n: int) -> list[MatrixRow]:
    """``n`` rows spread evenly over the design (a dry run's few: one per length where ``n`` allows), in its order."""
    if n <= 0 or n >= len(rows):
        return list(rows)
    return [rows[i * len(rows) // n] for i in range(n)]


def seed_spread(rows: Sequence[MatrixRow]) -> Counter[int]:
    return Counter(r.seed for r in rows)


def row_estimate_s(row: MatrixRow) -> float:
    """Solo and time-sliced: ``steps`` × (valley + train) each, plus each run's start."""
    return 2 * (row.steps * (row.valley_s + row.train_s) + RUN_START_S)


def capacity_estimate_s(levels: Sequence[int], capacity_s: float) -> float:
    """One capacity pass: a warm-up and each level kept full ``capacity_s`` beside its ramp."""
    return LEVEL_S + len(levels) * (capacity_s + LEVEL_S)


def total_estimate_s(rows: Sequence[MatrixRow], levels: Sequence[int], capacity_s: float) -> float:
    """Every row and two capacity passes per completion length (before its rows and after)."""
    return sum(map(row_estimate_s, rows)) + 2 * len({r.length for r in rows}) * capacity_estimate_s(levels, capacity_s)


def calls(rows: Sequence[MatrixRow], levels: Sequence[int], capacity_s: float, call_s: float) -> int:
    """Calls of ``call_s`` usable seconds the matrix takes, packed as the command packs them: in order, each length's
    pass before, its rows and its pass after, and what does not fit what a call has left starts in the next call."""
    pass_s = capacity_estimate_s(levels, capacity_s)
    steps = [s for length in dict.fromkeys(r.length for r in rows)
             for s in (pass_s, *(row_estimate_s(r) for r in rows if r.length == length), pass_s)]
    if any(s > call_s for s in steps):
        raise ValueError(f"a row or a capacity pass takes longer than a call of {call_s:.0f} s")
    n, left = 1, call_s
    for s in steps:
        if s > left:
            n, left = n + 1, call_s
        left -= s
    return n


def row_path(out: Path, row: MatrixRow) -> Path:
    return out / f"row-{row.name}.json"


def capacity_path(out: Path, length: int, when: str) -> Path:
    """A completion length's capacity pass, ``when`` ``before`` its rows or ``after``."""
    return out / f"capacity-{length}-{when}.json"


def pending(out: Path, rows: Sequence[MatrixRow]) -> list[MatrixRow]:
    """The rows a run still has to do: those whose row file is not in ``out`` (written only when a row ended)."""
    return [r for r in rows if not row_path(out, r).exists()]


def fits(rows: Sequence[MatrixRow], budget_s: float) -> list[MatrixRow]:
    """The leading rows whose estimates fit ``budget_s`` (0: no limit): a call starts no row it cannot finish."""
    if budget_s <= 0:
        return list(rows)
    out, spent = [], 0.0
    for r in rows:
        spent += row_estimate_s(r)
        if spent > budget_s:
            break
        out.append(r)
    return out


def design_table(rows: Sequence[MatrixRow]) -> str:
    lines = ["| # | completion tokens | valley s | train s | mix | seed | steps | estimate s |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {i} | {r.length} | {r.valley_s:g} | {r.train_s:g} | {r.mix.value} | {r.seed} | {r.steps} | "
              f"{row_estimate_s(r):.0f} |" for i, r in enumerate(rows)]
    return "\n".join(lines)


def _best(path: Path) -> float | None:
    if not path.exists():
        return None
    levels = json.loads(path.read_text())
    return max((c.get("steady_tokens_per_s") or c["tokens_per_s"] for c in levels), default=None)


def scored(out: Path, row: MatrixRow) -> dict[str, Any]:
    """A row's summary entry: its factors, and where it ran, its figures over the best capacity level of its length's
    passes before and after the rows (the reference the row was written with where the pass after is not there yet)."""
    entry: dict[str, Any] = row.factors()
    path = row_path(out, row)
    if not path.exists():
        return entry | {"done": False}
    r = json.loads(path.read_text())
    before, after = _best(capacity_path(out, row.length, "before")), _best(capacity_path(out, row.length, "after"))
    ref = r["capacity_tokens_per_s"]  # the pass before the rows, which the row was written with
    ref = max(x for x in (before, after, ref) if x is not None) if after else ref
    tokens = sum(v["tokens"] for v in r["valleys"])
    feeder = r.get("feeder") or {}
    return entry | {
        "done": True, "capacity_before": before, "capacity_after": after, "capacity_tokens_per_s": ref,
        "bracketed": after is not None, "valley_tokens": tokens,
        "serving_vs_capacity": round(tokens / r["vllm_s"] / ref, 4) if r.get("vllm_s") and ref else None,
        "idle_vs_capacity": round(tokens / r["trainer_idle_s"] / ref, 4) if r.get("trainer_idle_s") and ref else None,
        "step_ratio": r.get("step_ratio"), "wait_s_median": r.get("wait_s_median"), "wait_s_max": r.get("wait_s_max"),
        "cut": r.get("cut_tries"), "resumed": feeder.get("resumed"), "kept": feeder.get("kept"),
        "lost": r.get("lost"), "twice": r.get("twice")}


def summary(out: Path, rows: Sequence[MatrixRow]) -> dict[str, Any]:
    """Every row of the design (done or not) with its figures, and each length's capacity passes."""
    lengths = sorted({r.length for r in rows})
    return {"rows": [scored(out, r) for r in rows],
            "capacity": {str(n): {w: _best(capacity_path(out, n, w)) for w in ("before", "after")} for n in lengths},
            "done": sum(row_path(out, r).exists() for r in rows), "total": len(rows)}


def _f(value: Any, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _n(value: int | None) -> str:
    return "–" if value is None else str(value)


def summary_table(got: dict[str, Any]) -> str:
    """The summary as a table: a row's factors, its two figures, the trainer's cost, and the lines cut and resumed."""
    lines = [f"{got['done']} of {got['total']} rows done",
             "| completion tokens | valley s | train s | mix | seed | serving / capacity | idle / capacity | "
             "step ratio | wait median / max s | cut / resumed (tokens kept) | lost / twice |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in got["rows"]:
        head = f"| {r['length']} | {r['valley_s']:g} | {r['train_s']:g} | {r['mix']} | {r['seed']} |"
        if not r["done"]:
            lines.append(head + " not run | | | | | |")
            continue
        mark = "" if r["bracketed"] else " (no pass after yet)"
        lines.append(f"{head} {_f(r['serving_vs_capacity'])}{mark} | {_f(r['idle_vs_capacity'])} | "
                     f"{_f(r['step_ratio'], 4)} | {_f(r['wait_s_median'])} / {_f(r['wait_s_max'])} | "
                     f"{_n(r['cut'])} / {_n(r['resumed'])} ({_n(r['kept'])}) | {r['lost']} / {r['twice']} |")
    return "\n".join(lines)


__all__ = ["LENGTHS", "Mix", "MatrixRow", "PAIRS", "SEEDS", "TRAINS_S", "VALLEYS_S", "calls", "capacity_estimate_s",
           "capacity_path", "design", "design_table", "fits", "pending", "reduced",
           "row_estimate_s", "row_path", "rows_from", "scored", "seed_spread", "summary", "summary_table", "total_estimate_s",
           "uncovered"]
