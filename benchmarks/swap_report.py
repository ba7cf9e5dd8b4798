"""The swap benchmark's table, Markdown and timeline PNG, from its raw records (``swap.json``).

    python benchmarks/swap_report.py DIR      # re-renders DIR/swap.md and DIR/timeline.png from DIR/swap.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

GB = 1e9


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _awake(trans: list[dict[str, Any]], until: float) -> list[tuple[float, float]]:
    """Intervals the tenant served: from a reclaim's end to the next yield's start."""
    spans, since = [], None
    for t in sorted(trans, key=lambda t: t["start"]):
        if t["action"] == "tenant_reclaim" and t.get("ok", True):
            since = t["end"]
        elif t["action"] == "tenant_yield" and since is not None:
            spans.append((since, t["start"]))
            since = None
    if since is not None:
        spans.append((since, until))
    return spans


def _overlap(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans)


def _moves(rec: dict[str, Any], action: str) -> list[dict[str, Any]]:
    return [t for t in rec["transitions"] if t["action"] == action and t.get("ok", True)]


def summarize(rank0: dict[str, Any], ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    solo_step = statistics.median(rank0["solo"]["step_s"][1:] or rank0["solo"]["step_s"])
    rate = rank0["pinned_rate"]
    # byte figures are per rank: the node agent's (every rank of the node at once) are divided by its ranks
    node_ranks = rank0.get("local_world", rank0["world"])
    rows = []
    for i, phase in enumerate(rank0["phases"]):
        steady = phase["cycles"][1:] or phase["cycles"]
        trans = [t for c in phase["cycles"] for t in c["transitions"]]
        until = phase["cycles"][-1]["t_acquired"] if phase["cycles"] else 0.0
        awake = _awake(trans, until)
        serving = sum(_overlap(awake, c["t_release"], c["t_acquired"]) for c in steady)
        idle = sum(c["t_acquired"] - c["t_release"] for c in steady)
        out_s, back_s, moved, copying = [], [], [], []
        for c in steady:
            freeze = sum(t["end"] - t["start"] for t in _moves(c, "freeze"))
            thaw = sum(t["end"] - t["start"] for t in _moves(c, "thaw"))
            checkpointed = sum(t["bytes"] for t in _moves(c, "freeze")) / node_ranks if phase["mode"] != "park" else 0
            out_s.append(c["park_s"] + freeze)
            back_s.append(thaw + c["unpark_s"])
            moved.append(c["parked"] + checkpointed)
            # the part that moves bytes: the workers' park and the driver's checkpoint (not lock, checks, records)
            copying.append(c["park_s"] + sum(t.get("phases", {}).get("checkpoint", 0.0) for t in _moves(c, "freeze")
                                             if phase["mode"] != "park"))
        left = [t["left"] / node_ranks for c in steady for t in _moves(c, "freeze") if "left" in t]
        before, after = phase["load_before"], phase["load_after"]
        failed = sum(after.get(k, 0) - before.get(k, 0) for k in ("aborted", "errors", "failed"))  # runs before the
        # batch service counted aborted requests and client errors; with it a line fails only for good
        losses_same = all(r["phases"][i]["losses"] == r["solo"]["losses"][: len(r["phases"][i]["losses"])] for r in ranks)
        identical = [c.get("identical") for r in ranks for c in r["phases"][i]["cycles"] if "identical" in c]
        pinned_s = statistics.median(moved) / rate if moved else float("nan")
        rows.append({
            "mode": phase["mode"], "prepare": phase["prepare"], "cycles": len(steady), "handoffs": len(phase["cycles"]),
            "p1_med": statistics.median(c["acquire_s"] for c in steady), "p1_p95": _pct([c["acquire_s"] for c in steady], 0.95),
            "out_s": statistics.median(out_s), "back_s": statistics.median(back_s), "moved_gb": statistics.median(moved) / GB,
            "live_gb": statistics.median(c["live"] for c in steady) / GB, "pinned_s": pinned_s,
            "copy_s": statistics.median(copying),
            "p3": statistics.median(copying) / pinned_s if pinned_s else float("nan"),
            "left_gb": (statistics.median(left) / GB) if left else float("nan"),
            "p4": statistics.median(c["step_s"] for c in steady) / solo_step,
            "p5": serving / idle if idle else float("nan"), "p6": failed,
            "served": after["completed"] - before["completed"], "losses_as_solo": losses_same,
            "bit_identical": all(identical) if identical else None,
        })
    return rows


HEADER = ("| swap | prepare | cycles | P1 wait med / p95 s | swap out s | back s | moved GB | live GB | moving s "
          "| pinned copy s | P3 | left on GPU GB | P4 | P5 | P6 | served | loss = solo | bit-identical |")


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {'yes' if r['prepare'] else 'no'} | {r['cycles']} | {r['p1_med']:.3f} / {r['p1_p95']:.3f} "
            f"| {r['out_s']:.3f} | {r['back_s']:.3f} | {r['moved_gb']:.2f} | {r['live_gb']:.2f} | {r['copy_s']:.3f} "
            f"| {r['pinned_s']:.3f} "
            f"| {r['p3']:.2f} | {r['left_gb']:.2f} | {r['p4']:.3f} | {r['p5']:.3f} | {r['p6']} | {r['served']} "
            f"| {'yes' if r['losses_as_solo'] else 'NO'} "
            f"| {'-' if r['bit_identical'] is None else ('yes' if r['bit_identical'] else 'NO')} |"
        )
    return "\n".join(lines)


def timeline(rank0: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cycles = [c for ph in rank0["phases"] for c in ph["cycles"]]
    if not cycles:
        return
    t0 = cycles[0]["t_release"]
    trans = [t for c in cycles for t in c["transitions"]]
    fig, ax = plt.subplots(figsize=(14, 2.8))
    for c in cycles:
        ax.broken_barh([(c["t_acquired"] - t0, c["t_stepped"] - c["t_acquired"])], (20, 8), color="tab:blue")
        ax.broken_barh([(c["t_release"] - t0, c["t_released"] - c["t_release"]),
                        (c["t_acquire"] - t0, c["t_acquired"] - c["t_acquire"])], (20, 8), color="tab:red")
    awake = _awake(trans, cycles[-1]["t_acquired"])
    ax.broken_barh([(a - t0, b - a) for a, b in awake], (8, 8), color="tab:green")
    start = 0.0
    for ph in rank0["phases"]:
        if ph["cycles"]:
            start = ph["cycles"][0]["t_release"] - t0
            ax.text(start, 31, f"{ph['mode']}{' +prep' if ph['prepare'] else ''}", fontsize=8)
    ax.set_yticks([12, 24], ["vLLM serving", "trainer (blue: step, red: waits)"])
    ax.set_xlabel("seconds")
    ax.set_ylim(4, 36)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(ranks: list[dict[str, Any]], out: Path, title: str = "") -> str:
    rank0 = ranks[0]
    rows = summarize(rank0, ranks)
    table = markdown(rows)
    args = rank0["args"]
    live = max((r["live_gb"] for r in rows), default=0.0)
    head = (f"{title or 'Swap benchmark'}: {rank0['gpu']} × {rank0['world']}, live tensors {live:.2f} GB per rank, "
            f"pinned copy rate {rank0['pinned_rate'] / GB:.1f} GB/s (device → pinned host, {rank0['state_bytes'] / GB:.2f} GB "
            f"copied in this run), valley {args['valley']} s (warm-up cycle {args['warmup_valley']} s, not in the table), "
            f"solo step {statistics.median(rank0['solo']['step_s'][1:]):.3f} s\n\n"
            "swap out = the workers' park + the agent's freeze (lock, checks, checkpoint); back = thaw + unpark; "
            "moving s = the byte-moving part of swap out (park + driver checkpoint); moved, live and left on GPU are "
            "per rank (ranks move their own bytes side by side); P3 = moving s / pinned copy s of the same bytes; P1 = the trainer's wait at acquire (unpark included); P4 = step / solo step; "
            "P5 = vLLM serving time / trainer idle time; P6 = failed or aborted batch requests")
    (out / "swap.md").write_text(f"{head}\n\n{table}\n")
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    try:
        timeline(rank0, out / "timeline.png")
    except Exception as exc:  # the figures matter more than the picture
        head += f"\n(timeline not drawn: {exc})"
    return f"{head}\n\n{table}"


if __name__ == "__main__":
    d = Path(sys.argv[1])
    print(report(json.loads((d / "swap.json").read_text())["ranks"], d))
