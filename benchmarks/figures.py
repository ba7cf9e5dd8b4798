"""The measured tables of docs/measured.md, the guides and docs/architecture.md, recomputed from raw data.

Every table between ``<!-- figures:NAME -->`` and ``<!-- /figures -->`` in those files is printed by
this script from what is committed under ``benchmarks/results/`` (timelines, per-cycle JSON). ::

    python benchmarks/figures.py            # print every table
    python benchmarks/figures.py NAME       # one of them
    python benchmarks/figures.py --check    # exit 1 when a document's table differs from its data
    python benchmarks/figures.py --write    # rewrite the documents' tables from the data

``tests/test_figures.py`` runs ``--check``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "verl_run"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from figures_common import RESULTS, _f, _pct  # noqa: E402
from figures_harvest import (START256, harvest_cpu, harvest_h200, harvest_h200_pause, harvest_h200_session3,  # noqa: E402
                             harvest_h200_session4, harvest_h200_session5,
                             harvest_h200_session6, harvest_h200_session7, harvest_h200_curve48,
                             harvest_h200_by_running, harvest_h200_waves, harvest_start256_service,
                             harvest_h200_session8, harvest_h200_frontend, harvest_h200_by_running_session8,
                             policy_push_h200, validate_h200)
from figures_limits import harvest_h200_by_limit, harvest_h200_drift, harvest_h200_session9  # noqa: E402
from figures_session10 import (harvest_h200_by_limit_session10, harvest_h200_drift_session10,  # noqa: E402
                               harvest_h200_pace, harvest_h200_session10)
from figures_session11 import (harvest_h200_around_session11, harvest_h200_by_limit_session11,  # noqa: E402
                               harvest_h200_engine_stacks, harvest_h200_pace_rounds, harvest_h200_passes_session11,
                               harvest_h200_session11, harvest_h200_step_length)
from figures_session12 import (harvest_h200_at_pace, harvest_h200_by_limit_session12,  # noqa: E402
                               harvest_h200_cpu_pace, harvest_h200_session12)
from figures_session13 import harvest_h200_session13, harvest_h200_step_session13  # noqa: E402
from figures_session14 import (harvest_h200_lent_session14, harvest_h200_session14,  # noqa: E402
                               harvest_h200_step_session14)
from figures_session15 import (harvest_h200_bounds_session15, harvest_h200_lent_session15,  # noqa: E402
                               harvest_h200_session15, harvest_h200_step_session15)
from summarize import _records, timeline_figures  # noqa: E402

DOCS = ("README.md", "docs/measured.md", "guides/rl-batch-interleaving/README.md", "guides/multi-gpu-trainers.md",
        "docs/architecture.md", "guides/batch-cluster.md")
BLOCK = re.compile(r"(<!-- figures:([\w-]+) -->\n)(.*?)(<!-- /figures -->)", re.S)


def verl_run() -> str:
    """verl 0.9.1 fully-async, 0.39 B, 2 × H200 (2026-11-30): what each run's timeline shows."""
    folder = RESULTS / "2026-11-30-verl-h200x2"
    runs = [("`+timeslice=interleave` (checkpoint)", "interleave"),
            ("`… timeslice.handoff.swap=park`, 6 steps", "interleave-park"),
            ("`… timeslice.handoff.swap=park`, 8 steps", "interleave-park-8steps")]
    lines = ["| run | steps | trainer wait s (median / max) | freezes | freeze s | thaw s | checkpointed GB "
             "| parked GB (park s / unpark s) | left on GPU GB | vLLM / run | vLLM / trainer idle | failed moves |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, name in runs:
        r = timeline_figures(_records(folder / f"{name}-timeline.jsonl"))
        parked = "–" if r["parked_gb_median"] is None else \
            f"{_f(r['parked_gb_median'])} ({_f(r['park_s_median'], 3)} / {_f(r['unpark_s_median'], 3)})"
        lines.append(
            f"| {label} | {r['steps_in_timeline']} | {_f(r['trainer_wait_s_median'])} / {_f(r['trainer_wait_s_max'])} "
            f"| {r['freezes']} | {_f(r['freeze_s_median'], 3)} | {_f(r['thaw_s_median'], 3)} "
            f"| {_f(r['checkpointed_gb_median'])} | {parked} | {_f(r['left_gb_median'])} | {_pct(r['vllm_of_run'])} "
            f"| {_pct(r['vllm_of_idle'])} | {r['failed_transitions']} |")
    return "\n".join(lines)


def cuda_cycles() -> str:
    """The CUDA driver through the agent on one H200: 50 freeze/thaw cycles of a 2.99 GB torch worker."""
    data = json.loads((RESULTS / "2026-11-30-h200-cuda-50-cycles" / "gpu50.json").read_text())
    cycles = data["cycles"]

    def span(key: str, scale: float = 1.0, digits: int = 2) -> str:
        values = [c[key] * scale for c in cycles]
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"

    def rate(key: str) -> str:
        values = [c["bytes"] / 1e9 / c[key] for c in cycles if c[key]]
        return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"

    intact = sum(bool(c["data_intact"]) for c in cycles)
    return "\n".join([
        "| step | median (min–max) | GB/s median (min–max) |",
        "|---|---|---|",
        f"| lock ms | {span('lock_s', 1e3)} | |",
        f"| checkpoint (GPU → host) s | {span('checkpoint_s')} | {rate('checkpoint_s')} |",
        f"| restore (host → GPU) s | {span('restore_s')} | {rate('restore_s')} |",
        f"| unlock ms | {span('unlock_s', 1e3)} | |",
        f"| cycles with the worker's data intact | {intact} of {len(cycles)} | |",
    ])


def _rows(run: str) -> list[dict[str, Any]]:
    return json.loads((RESULTS / run / "rows.json").read_text())


def swap_one_gpu() -> str:
    """benchmarks/swap.py on one H200 with a real vLLM tenant: every swap mode, with and without prepare."""
    lines = ["| swap | prepare | trainer wait at acquire s (median) | out s | back s | moved GB | left on GPU GB "
             "| step / solo | vLLM serving / trainer idle | failed requests |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in _rows("2026-11-30-h200-swap"):
        lines.append(f"| {r['mode']} | {'yes' if r['prepare'] else 'no'} | {r['p1_med']:.3f} | {r['out_s']:.3f} "
                     f"| {r['back_s']:.3f} | {r['moved_gb']:.2f} | {r['left_gb']:.2f} | {r['p4']:.3f} | {r['p5']:.2f} "
                     f"| {r['p6']} |")
    return "\n".join(lines)


def swap_two_gpus() -> str:
    """benchmarks/swap_run.sh two on 2 × H200: 20 handoffs per mode, medians, bytes per rank."""
    runs = [("valley-1s", "1 s · ccef95b (one rank after the other)"),
            ("valley-1s-concurrent", "1 s · 2e0e097 (side by side)"), ("valley-4s", "4 s · ccef95b")]
    lines = ["| swap | valleys · agent | trainer wait at acquire s | out s | back s | moved GB | left on GPU GB "
             "| vLLM serving / trainer idle | completions | bit-identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run, label in runs:
        for r in _rows(f"2026-11-30-h200x2-multigpu/{run}"):
            lines.append(f"| {r['mode']} | {label} | {r['p1_med']:.3f} | {r['out_s']:.3f} | {r['back_s']:.3f} "
                         f"| {r['moved_gb']:.2f} | {r['left_gb']:.2f} | {r['p5']:.3f} | {r['served']} "
                         f"| {'yes' if r['bit_identical'] and r['losses_as_solo'] else 'NO'} |")
    return "\n".join(lines)


def side_by_side() -> str:
    """How much issuing a job's checkpoints at once gains, from the medians of the two 1 s runs."""
    one = {r["mode"]: r for r in _rows("2026-11-30-h200x2-multigpu/valley-1s")}["checkpoint"]
    two = {r["mode"]: r for r in _rows("2026-11-30-h200x2-multigpu/valley-1s-concurrent")}["checkpoint"]
    return (f"checkpoint of two ranks one after the other {one['out_s']:.2f} s, side by side {two['out_s']:.2f} s "
            f"({one['out_s'] / two['out_s']:.2f}×); restore {one['back_s']:.2f} s vs {two['back_s']:.2f} s "
            f"({one['back_s'] / two['back_s']:.2f}×); medians of 19 handoffs each, two runs minutes apart")


def ladder_cpu() -> str:
    """The reclaim ladder on CPU with the stand-in vLLM: the trainer's acquire against the deadline."""
    import ladder

    data = json.loads((RESULTS / "2026-11-30-cpu-ladder" / "ladder.json").read_text())
    return ladder.table(data["rows"], data["deadline_s"])


def ladder_h200() -> str:
    """The ladder against a real vLLM 0.24 on one H200: polite yields under load, then a stopped server."""
    import ladder

    data = json.loads((RESULTS / "2026-11-30-h200-ladder" / "ladder-vllm.json").read_text())
    keep = [r for r in data["rows"] if r["scenario"] == "vllm-keep"]
    return (ladder.table(data["rows"], data["deadline_s"]) + "\n\n"
            f"Batch requests during the `vllm-keep` cycles: {keep[0]['requests_ok']} completed, "
            f"{keep[0]['requests_failed']} failed.")


def valleys_h200() -> str:
    """benchmarks/valleys.py on one H200 (2026-12-01): the demo's fully-async schedule solo and time-sliced,
    the interleave side recomputed from its timeline, the step times from each step's record."""
    import valleys

    from timeslice_verl import analysis

    folder = RESULTS / "2026-12-01-h200-valleys"
    data = json.loads((folder / "valleys.json").read_text())
    shared = analysis.summary(analysis.load(folder / "interleave" / "run.jsonl"))
    for run in ("solo", "interleave"):
        data[run]["step_s_median"] = statistics.median(s["step_s"] for s in data[run]["steps_detail"])
    shared |= {k: data["interleave"][k] for k in ("step_s_median", "batch", "worker_data_intact", "steps_detail")}
    return valleys.table(valleys.row(data["solo"], shared, "even", "park"))


def _valley_rows(folder: Path, parts: tuple[tuple[str, str | None], ...]) -> list[dict[str, Any]]:
    """valleys.py's rows for each ``(part, label)`` of ``folder``: every time-sliced run recomputed from its timeline,
    beside its solo run on the same schedule (``label`` replaces the profile's name when given)."""
    import valleys

    from timeslice_verl import analysis

    rows = []
    for part, label in parts:
        data = json.loads((folder / part / "valleys.json").read_text())
        for run in data["runs"]:
            shared = analysis.summary(analysis.load(folder / part / run["profile"] / run["mode"] / "run.jsonl"))
            shared |= {k: run["interleave"][k] for k in ("step_s_median", "batch", "worker_data_intact", "parked_gib_max",
                                                         "steps_detail", "swaps") if k in run["interleave"]}
            rows.append(valleys.row(run["solo"], shared, label or run["profile"], run["mode"]))
    return rows


def valleys_round5_h200() -> str:
    """benchmarks/valleys.py on one H200 with a real vLLM 0.24 tenant (2026-12-01, after the resident swap):
    each time-sliced run recomputed from its timeline, beside its solo run on the same schedule."""
    import valleys

    return valleys.table(_valley_rows(RESULTS / "2026-12-01-h200-valleys-round5", (("v-even", None), ("v-ckpt", None))))


def valleys_round6_h200() -> str:
    """The same on one H200 after the tenant's warm-up (2026-12-01): the even profile twice (first with a full
    garbage collection at every release, then only when it can free GPU memory), fleet and longtail."""
    import valleys

    return valleys.table(_valley_rows(RESULTS / "2026-12-01-h200-valleys-round6", (
        ("v-even-first", "even (first run: gc at every release)"), ("v-even", "even"), ("v-fleet", "fleet"),
        ("v-longtail", "longtail"))))


def cluster_queue() -> str:
    """benchmarks/cluster_queue.py on this 2-core CPU machine (2026-12-02): one PostgreSQL queue, 1/2/4 feeders each
    beside a stand-in of 100 lines/s."""
    rows = json.loads((RESULTS / "2026-12-02-cpu-cluster-queue" / "cluster-queue.json").read_text())["rows"]
    lines = ["| feeders | lines/s | tenants' capacity, lines/s | vs capacity | CPU ms per line: feeders / API / database |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['feeders']} | {r['lines_per_s']:.1f} | {r['capacity_lines_per_s']:.0f} | {r['vs_capacity']:.3f} | "
                     f"{r['cpu_ms_per_line_feeders']:.2f} / {r['cpu_ms_per_line_api']:.2f} / "
                     f"{r['cpu_ms_per_line_database']:.2f} |")
    return "\n".join(lines)


TABLES: dict[str, Callable[[], str]] = {
    "cluster-queue": cluster_queue,
    "harvest-h200-start256": lambda: harvest_h200_pause(START256, {"run4": "start 256", "run5": "start 256",
                                                                   "run6": "start 256", "run7": "+ gate at yield"}),
    "harvest-h200-start256-service": harvest_start256_service,
    "harvest-h200-session3": harvest_h200_session3, "harvest-h200-session4": harvest_h200_session4,
    "harvest-h200-session5": harvest_h200_session5, "harvest-h200-session6": harvest_h200_session6,
    "harvest-h200-session7": harvest_h200_session7, "harvest-h200-curve48": harvest_h200_curve48,
    "harvest-h200-by-running": harvest_h200_by_running,
    "harvest-h200-waves": harvest_h200_waves, "validate-h200": validate_h200,
    "harvest-h200-session8": harvest_h200_session8, "harvest-h200-frontend": harvest_h200_frontend,
    "harvest-h200-by-running-session8": harvest_h200_by_running_session8,
    "harvest-h200-session9": harvest_h200_session9, "harvest-h200-by-limit": harvest_h200_by_limit,
    "harvest-h200-drift": harvest_h200_drift,
    "harvest-h200-session10": harvest_h200_session10, "harvest-h200-by-limit-session10": harvest_h200_by_limit_session10,
    "harvest-h200-drift-session10": harvest_h200_drift_session10, "harvest-h200-pace": harvest_h200_pace,
    "harvest-h200-session11": harvest_h200_session11, "harvest-h200-by-limit-session11": harvest_h200_by_limit_session11,
    "harvest-h200-passes-session11": harvest_h200_passes_session11,
    "harvest-h200-engine-stacks": harvest_h200_engine_stacks, "harvest-h200-pace-rounds": harvest_h200_pace_rounds,
    "harvest-h200-around-session11": harvest_h200_around_session11, "harvest-h200-step-length": harvest_h200_step_length,
    "harvest-h200-session12": harvest_h200_session12, "harvest-h200-by-limit-session12": harvest_h200_by_limit_session12,
    "harvest-h200-cpu-pace": harvest_h200_cpu_pace, "harvest-h200-at-pace": harvest_h200_at_pace,
    "harvest-h200-session13": harvest_h200_session13, "harvest-h200-step-session13": harvest_h200_step_session13,
    "harvest-h200-session14": harvest_h200_session14, "harvest-h200-lent-session14": harvest_h200_lent_session14,
    "harvest-h200-step-session14": harvest_h200_step_session14,
    "harvest-h200-session15": harvest_h200_session15, "harvest-h200-bounds-session15": harvest_h200_bounds_session15,
    "harvest-h200-lent-session15": harvest_h200_lent_session15, "harvest-h200-step-session15": harvest_h200_step_session15,
    "policy-push-h200": policy_push_h200,
    "harvest-h200": harvest_h200, "harvest-h200-pause": harvest_h200_pause, "harvest-cpu": harvest_cpu,
    "harvest-cpu-stream": lambda: harvest_cpu(RESULTS / "2026-12-02-cpu-harvest"),
    "valleys-h200": valleys_h200, "valleys-round5-h200": valleys_round5_h200, "valleys-round6-h200": valleys_round6_h200, "ladder-cpu": ladder_cpu, "ladder-h200": ladder_h200,
    "verl-run": verl_run, "cuda-cycles": cuda_cycles, "swap-one-gpu": swap_one_gpu,
    "swap-two-gpus": swap_two_gpus, "side-by-side": side_by_side,
}


def documents(root: Path = ROOT) -> dict[str, str]:
    return {name: (root / name).read_text() for name in DOCS}


def stale(root: Path = ROOT) -> list[str]:
    """``doc: table`` for every generated block that differs from what the data gives (or names no table)."""
    out = []
    for doc, text in documents(root).items():
        for match in BLOCK.finditer(text):
            name = match.group(2)
            if name not in TABLES:
                out.append(f"{doc}: unknown table {name!r}")
            elif match.group(3).strip() != TABLES[name]().strip():
                out.append(f"{doc}: {name}")
    return out


def write(root: Path = ROOT) -> None:
    for doc, text in documents(root).items():
        new = BLOCK.sub(lambda m: m.group(1) + TABLES[m.group(2)]() + "\n" + m.group(4), text)
        if new != text:
            (root / doc).write_text(new)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", choices=sorted(TABLES))
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.check:
        bad = stale()
        for line in bad:
            print(f"differs from its data: {line}", file=sys.stderr)
        return 1 if bad else 0
    if args.write:
        write()
        return 0
    for name in [args.name] if args.name else TABLES:
        print(f"## {name}\n{TABLES[name]()}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
