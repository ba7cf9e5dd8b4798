"""The harvest benchmark's scoring (``benchmarks/harvest.py``), pure over its raw data: each lent valley's tokens from
vLLM's own counter, the figures over the capacity, a row read again over a bracketed capacity or recomputed from the
files beside it; the table harvest.py prints last."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LEFT_OUT = ("input-*.jsonl", "head-*.jsonl", "*.sqlite*", "batch-input.jsonl", "*-output*.jsonl")
"""What a recorded run leaves out of its archive: the batch inputs and outputs and the databases (the figures are in
the rows, ``harvest.json`` and the logs)."""


def valleys(run_jsonl: Path) -> list[tuple[float, float]]:
    """Each lent valley of a time-sliced run: a release to the next acquire (its ``run.jsonl``), as (start, end)."""
    events = [json.loads(x) for x in run_jsonl.read_text().split("\n") if x]
    marks = [(e["time"], e["action"]) for e in events if e.get("hook") == "handoff" and e.get("ok", True)]
    return [(t0, t1) for (t0, a0), (t1, a1) in zip(marks, marks[1:]) if a0 == "release" and a1 == "acquire"]


def valley_tokens(run_jsonl: Path, inflight: Path, phase: str) -> list[dict[str, Any]]:
    """Each lent valley of a time-sliced run (:func:`valleys`) with the tokens vLLM generated in it (its counter, as
    the sampler read it in ``phase``)."""
    reads = [(r["t"], r["generated"]) for r in (json.loads(x) for x in inflight.read_text().split("\n") if x)
             if r.get("phase") == phase and r.get("generated") is not None]
    out = []
    for t0, t1 in valleys(run_jsonl):
        g0, g1 = counter_at(reads, t0), counter_at(reads, t1)
        if g0 is not None and g1 is not None:
            out.append({"start": round(t0, 3), "seconds": round(t1 - t0, 3), "tokens": round(g1 - g0),
                        "tokens_per_s": round((g1 - g0) / (t1 - t0), 1) if t1 > t0 else None})
    return out


def counter_at(reads: list[tuple[float, float]], t: float) -> float | None:
    """vLLM's counter at ``t``, linear between the two reads around it (read every 100 ms: taking the reads inside
    a valley alone would miss up to a tenth of a second at each end); None outside the reads."""
    for (ta, ga), (tb, gb) in zip(reads, reads[1:]):
        if ta <= t <= tb:
            return ga + (gb - ga) * ((t - ta) / (tb - ta) if tb > ta else 0.0)
    return None


def phase_generated(inflight: Path, phase: str) -> float:
    """Tokens vLLM generated through one phase (its counter, first read to last): in a time-sliced phase all of them
    in the valleys, the tenant being paused or asleep outside them."""
    reads = [r["generated"] for r in (json.loads(x) for x in inflight.read_text().split("\n") if x)
             if r.get("phase") == phase and r.get("generated") is not None]
    return reads[-1] - reads[0] if len(reads) >= 2 else 0.0


def valley_figures(r: dict[str, Any]) -> dict[str, Any]:
    """The harvest's two figures over the tokens vLLM generated inside the lent valleys (release → acquire, its own
    counter): per second the tenant had the GPU in the trainer's run (the timeline's ``vLLM`` seconds) and per second
    the trainer was idle, each over the capacity. The batch's completed lines are not the measure: the run's end cuts
    lines off, and the tenant drains what it holds after the trainer's last step (tokens outside every valley)."""
    tokens = sum(v["tokens"] for v in r["valleys"])
    best = r["capacity_tokens_per_s"]
    return {"valley_tokens": tokens,
            "serving_vs_capacity": round(tokens / r["vllm_s"] / best, 4) if r.get("vllm_s") else None,
            "idle_vs_capacity": round(tokens / r["trainer_idle_s"] / best, 4) if r.get("trainer_idle_s") else None}


def rescore(folder: Path) -> None:
    """Rows written before :func:`valley_figures` (their ratios over the batch's completed lines): the figures again
    from the raw data beside them, the old ratios kept as ``*_batch_tokens``."""
    for path in sorted(folder.glob("row-*.json")):
        r = json.loads(path.read_text())
        if "valley_tokens" in r:
            continue
        auto = folder / f"mix-{r['mix_tokens']}" / r["profile"] / "auto"
        summary = json.loads((auto / "summary.json").read_text())
        r["valleys"] = valley_tokens(auto / "run.jsonl", folder / "inflight.jsonl", f"timesliced-{r['mix_tokens']}-{r['profile']}")
        r["serving_vs_capacity_batch_tokens"], r["idle_vs_capacity_batch_tokens"] = r["serving_vs_capacity"], r["idle_vs_capacity"]
        r["batch_tokens"], r["vllm_s"] = r.pop("tokens"), summary["seconds"]["vLLM"]
        r.update(valley_figures(r))
        path.write_text(json.dumps(r, indent=1) + "\n")


def steady_best(levels: list[dict[str, Any]]) -> float:
    """A capacity pass's best level: its steady rate (the first and last waves left out), else its whole one."""
    return max((c.get("steady_tokens_per_s") or c["tokens_per_s"] for c in levels), default=0.0)


def bracketed(out: Path, r: dict[str, Any], before: float, after: float, alone: float | None,
              every: float | None = None) -> dict[str, Any]:
    """A time-sliced row over the best of the capacity passes around it (its file rewritten), and over the higher of
    that and the service alone (``*_vs_highest``): the strictest reading of the same tokens; ``every``: the best of
    all the mix's passes, the row's figures over it too (``*_vs_all_passes``)."""
    r = dict(r, capacity_before=before, capacity_after=after, capacity_tokens_per_s=max(before, after),
             service_alone_tokens_per_s=alone)
    r.update(valley_figures(r))
    over = {"highest": max(r["capacity_tokens_per_s"], alone or 0.0)} | ({"all_passes": every} if every else {})
    for name, high in over.items():
        for key in ("serving", "idle"):
            value = r.get(f"{key}_vs_capacity")
            r[f"{key}_vs_{name}"] = round(value * r["capacity_tokens_per_s"] / high, 4) if value is not None else None
    (out / f"row-{r['mix_tokens']}-{r['profile']}.json").write_text(json.dumps(r, indent=1) + "\n")
    return r


def bracket_rows(out: Path, rows: list[dict[str, Any]], passes: list[float], alone: float | None) -> list[dict[str, Any]]:
    """Each row over the best of the capacity passes around it: ``passes`` the best steady level of each pass in the
    order they ran, one before the first row and one after each row (``--bracket-rows``: the server's own pace moved
    by up to half between passes minutes apart on an H200 on 2026-12-03), or one before all and one after all
    (``--bracket``). Each row also keeps its figures over the best of every pass of the mix (``*_vs_all_passes``)."""
    if len(passes) not in (2, len(rows) + 1):
        raise ValueError(f"{len(passes)} capacity passes for {len(rows)} rows: one before and one after all, or each")
    around = [(passes[i], passes[i + 1]) if len(passes) == len(rows) + 1 else (passes[0], passes[-1])
              for i in range(len(rows))]
    every = max(passes) if len(passes) > 2 else None  # two passes: the best of all is the reference itself
    return [bracketed(out, r, before, after, alone, every) for r, (before, after) in zip(rows, around)]


def table(result: dict[str, Any]) -> str:
    out = []
    for mix, got in result["mixes"].items():
        caps = ", ".join(f"{c['inflight']}: {c['tokens_per_s']:.0f}" for c in got.get("capacity", []))
        out.append(f"{mix}-token completions — capacity tokens/s by requests in flight: {caps or '–'}")
        for s in (got[k] for k in ("service_alone", "service_alone_other") if k in got):
            out.append(f"  service alone{' (sends spread)' if s.get('spread') else ''}: {s['tokens_per_s']:.0f} tokens/s "
                       f"({s['vs_capacity']} of capacity), {s['completed']}/{s['lines']} lines, limit at end "
                       f"{s['limit_at_end']}")
        for s in got.get("service_fixed", []):
            out.append(f"  service, {s['fixed']} in flight: {s['tokens_per_s']:.0f} tokens/s ({s['vs_capacity']} of capacity), "
                       f"{s['completed']}/{s['lines']} lines")
        for profile, levels in (got.get("capacity_between") or {}).items():
            caps = ", ".join(f"{c['inflight']}: {c['tokens_per_s']:.0f}" for c in levels)
            out.append(f"  capacity again after the {profile} row: {caps}")
        if "capacity_after" in got:
            caps = ", ".join(f"{c['inflight']}: {c['tokens_per_s']:.0f}" for c in got["capacity_after"])
            around = "the passes around each row" if got.get("capacity_between") else "both passes"
            out.append(f"  capacity again after (c): {caps}; the reference: the best steady level of {around}")
        for r in got.get("timesliced", []):
            strict = (f"  (over the higher of it and (b): {r['serving_vs_highest']} / {r['idle_vs_highest']})"
                      if "serving_vs_highest" in r else "")
            if got.get("capacity_between"):
                strict += f"  (over the best of all passes: {r['serving_vs_all_passes']} / {r['idle_vs_all_passes']})"
            out.append(f"  {r['profile']:9} serving/capacity {r['serving_vs_capacity']}  idle/capacity {r['idle_vs_capacity']}  "
                       f"step ratio {r['step_ratio']}  wait median {r['wait_s_median']} s max {r['wait_s_max']} s  "
                       f"vLLM of idle {r['vllm_of_idle']}  lost {r['lost']} twice {r['twice']}{strict}")
    return "\n".join(out)


def summary(out: Path) -> str:
    """The manifest's line for a harvest.py folder: each time-sliced row's serving and idle over the capacity."""
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("row-*.json"))]
    return "; ".join(f"{r['mix_tokens']}-token {r['profile']}: serving/capacity {r['serving_vs_capacity']}, "
                     f"idle/capacity {r['idle_vs_capacity']}" for r in rows) or "no time-sliced rows"
