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
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks" / "verl_run"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from summarize import _records, timeline_figures  # noqa: E402

DOCS = ("README.md", "docs/measured.md", "guides/rl-batch-interleaving/README.md", "guides/multi-gpu-trainers.md",
        "docs/architecture.md", "guides/batch-cluster.md")
BLOCK = re.compile(r"(<!-- figures:([\w-]+) -->\n)(.*?)(<!-- /figures -->)", re.S)


def _f(value: Any, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pct(value: Any) -> str:
    return "–" if value is None else f"{value * 100:.0f} %"


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


def _harvest_log(run: Path) -> dict[str, Any]:
    """harvest.py's JSON lines of one run: the capacity levels and the service alone."""
    out: dict[str, Any] = {"capacity": []}
    for line in (run / "harvest.log").read_text().splitlines():
        if line.startswith('{"capacity"'):
            out["capacity"].append(json.loads(line)["capacity"])
        elif line.startswith('{"service_alone"'):
            out["alone"] = json.loads(line)["service_alone"]
        elif line.startswith('{"service_fixed"'):
            out.setdefault("fixed", []).append(json.loads(line)["service_fixed"])
    return out


def harvest_h200() -> str:
    """benchmarks/harvest.py on one H200 (2026-12-01), 48-token completions, 20 000 lines: each run's capacity, the
    service alone, and the fleet schedule time-sliced, as ratios within the run."""
    folder = RESULTS / "2026-12-01-h200-harvest"
    lines = ["| run | capacity best, tokens/s | service alone / capacity | fleet: serving / capacity | idle / capacity | "
             "step ratio | wait median / max s | tokens per tenant-GPU s |", "|---|---|---|---|---|---|---|---|"]
    for run in ("run1", "run2", "run3"):
        got = _harvest_log(folder / run)
        best = max(c["tokens_per_s"] for c in got["capacity"])
        row_path = folder / run / "row-48-fleet.json"
        r = json.loads(row_path.read_text()) if row_path.exists() else {}
        fleet = (f"{_f(r['serving_vs_capacity'], 3)} | {_f(r['idle_vs_capacity'], 3)} | {_f(r['step_ratio'], 4)} | "
                 f"{_f(r['wait_s_median'], 3)} / {_f(r['wait_s_max'], 3)} | {r['tokens_per_gpu_s']:.0f}") if r else "– | – | – | – | –"
        lines.append(f"| {run[-1]} | {best:.0f} | {_f(got['alone']['tokens_per_s'] / best, 3)} | {fleet} |")
    return "\n".join(lines)


def harvest_h200_pause(folder: Path = RESULTS / "2026-12-02-h200-harvest",
                       code: dict[str, str] | None = None) -> str:
    """benchmarks/harvest.py on one H200 (2026-12-02), 20 000 lines: yields that only pause the tenant where memory
    allows; each run's capacity and the time-sliced rows, as ratios within the run."""
    lines = ["| run | code | mix | capacity best, tokens/s | service alone / capacity | profile | serving / capacity | "
             "idle / capacity | step ratio | wait median / max s | tokens per tenant-GPU s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    code = code or {"run1": "9eda120 + tenants", "run2": "9eda120 + tenants", "run3": "40b5e63"}
    for run in code:
        got = _harvest_log(folder / run)
        best = max(c["tokens_per_s"] for c in got["capacity"])
        alone = _f(got["alone"]["tokens_per_s"] / best, 3) if "alone" in got else "–"
        for row_path in sorted((folder / run).glob("row-*.json")):
            r = json.loads(row_path.read_text())
            lines.append(f"| {run[-1]} | {code[run]} | {r['mix_tokens']} | {best:.0f} | {alone} | {r['profile']} | "
                         f"{_f(r['serving_vs_capacity'], 3)} | {_f(r['idle_vs_capacity'], 3)} | {_f(r['step_ratio'], 4)} | "
                         f"{_f(r['wait_s_median'], 3)} / {_f(r['wait_s_max'], 3)} | {r['tokens_per_gpu_s']:.0f} |")
    return "\n".join(lines)


START256 = RESULTS / "2026-12-02-h200-harvest-start256"


def harvest_start256_service() -> str:
    """Run 4 of 2026-12-02-h200-harvest-start256: the service alone starting at 256 in flight, then held at 256 and at
    512, against the capacity measured in the same run."""
    got = _harvest_log(START256 / "run4")
    best = max(c["tokens_per_s"] for c in got["capacity"])
    lines = ["| the service alone, 6 000 lines of 48 tokens | tokens/s | / capacity | CPU ms per line |", "|---|---|---|---|"]
    for label, r in [(f"starts at 256, follows vLLM (limit at end {got['alone']['limit_at_end']})", got["alone"]),
                     *((f"held at {r['fixed']}", r) for r in got.get("fixed", []))]:
        lines.append(f"| {label} | {r['tokens_per_s']:.0f} | {_f(r['tokens_per_s'] / best, 3)} | "
                     f"{_f(r['service_cpu_ms_per_line'], 2)} |")
    return "\n".join(lines)


SESSION3 = RESULTS / "2026-12-02-h200-harvest-session3"


def harvest_h200_session3() -> str:
    """Runs 8–10 (one H200, 2026-12-02, third session): every ratio over the best whole-level rate of the same run's
    capacity (an async client at 32/128/256/512 in flight: no estimator), beside the reference the run itself used."""
    code = {"run8": "09b1462", "run9": "09b1462", "run10": "b334c21"}
    lines = ["| run | code | mix | capacity, whole level best / the run's reference, tokens/s | service alone / capacity | "
             "profile | serving / capacity | idle / capacity | step ratio | wait median / max s | tokens per tenant-GPU s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in code:
        got = _harvest_log(SESSION3 / run)
        best = max(c["tokens_per_s"] for c in got["capacity"])
        ref = max(c.get("steady_tokens_per_s") or c["tokens_per_s"] for c in got["capacity"])
        alone = _f(got["alone"]["tokens_per_s"] / best, 3) if "alone" in got else "–"
        for row_path in sorted((SESSION3 / run).glob("row-*.json")):
            r = json.loads(row_path.read_text())
            idle = r["tokens"] / r["trainer_idle_s"] / best
            lines.append(f"| {run[3:]} | {code[run]} | {r['mix_tokens']} | {best:.0f} / {ref:.0f} | {alone} | {r['profile']} | "
                         f"{_f(r['tokens_per_gpu_s'] / best, 3)} | {_f(idle, 3)} | {_f(r['step_ratio'], 4)} | "
                         f"{_f(r['wait_s_median'], 3)} / {_f(r['wait_s_max'], 3)} | {r['tokens_per_gpu_s']:.0f} |")
    return "\n".join(lines)


SESSION4 = RESULTS / "2026-12-02-h200-harvest-session4"


def harvest_h200_session4() -> str:
    """Runs 11–12 (one H200, 2026-12-02, fourth session, code ae603aa): the figures over the tokens vLLM generated
    inside the lent valleys (``valley_figures``), the run's own steady capacity the reference; the ratios over the
    batch's completed lines (the older measure, which counts the drain after the trainer's end) beside them."""
    lines = ["| run | mix | capacity, steady best (whole level best), tokens/s | service alone / capacity | profile | "
             "serving / capacity | idle / capacity | the same over completed lines | step ratio | wait median / max s | "
             "a valley's tokens/s, lowest–highest |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in ("run11", "run12"):
        got = _harvest_log(SESSION4 / run)
        whole = max(c["tokens_per_s"] for c in got["capacity"])
        for row_path in sorted((SESSION4 / run).glob("row-*.json")):
            r = json.loads(row_path.read_text())
            ref = r["capacity_tokens_per_s"]
            alone = _f(got["alone"]["tokens_per_s"] / ref, 3) if "alone" in got else "–"
            rates = [v["tokens_per_s"] for v in r["valleys"]]
            lines.append(f"| {run[3:]} | {r['mix_tokens']} | {ref:.0f} ({whole:.0f}) | {alone} | {r['profile']} | "
                         f"{_f(r['serving_vs_capacity'], 3)} | {_f(r['idle_vs_capacity'], 3)} | "
                         f"{_f(r['serving_vs_capacity_batch_tokens'], 3)} / {_f(r['idle_vs_capacity_batch_tokens'], 3)} | "
                         f"{_f(r['step_ratio'], 4)} | {_f(r['wait_s_median'], 3)} / {_f(r['wait_s_max'], 3)} | "
                         f"{min(rates):.0f}–{max(rates):.0f} |")
    return "\n".join(lines)


def policy_push_h200() -> str:
    """benchmarks/policy_push.py on one H200 (2026-12-02): the trainer process's weights pushed into a co-resident
    vLLM through vLLM's IPC weight transfer, greedy answers compared."""
    got = json.loads((RESULTS / "2026-12-02-h200-policy-push" / "policy_push.json").read_text())
    lines = ["| step | version | push s | tensors | GB |", "|---|---|---|---|---|"]
    for r in got["rows"]:
        lines.append(f"| {r['step']} | {r['version'] if r['version'] is not None else '–'} | {_f(r['push_s'], 3)} | "
                     f"{r['tensors'] or '–'} | {_f(r['gb'], 3)} |")
    checks = ", ".join(f"{k.replace('_', ' ')}: {'yes' if v else 'NO'}" for k, v in got["checks"].items())
    return "\n".join(lines) + f"\n\n{checks}."


def harvest_cpu(folder: Path = RESULTS / "2026-12-01-cpu-harvest") -> str:
    """benchmarks/harvest_cpu.py on this 2-core CPU machine: the service alone against the stand-in of known capacity,
    this tree and the tree before the change (38d0fd7) one after the other."""
    rows = [json.loads(x) for x in (folder / "rows.jsonl").read_text().splitlines()]
    meta = json.loads((folder / "meta.json").read_text())
    lines = ["| service | lines | lines/s (stand-in: %.0f) | CPU ms/line | first tenth | last tenth | peak RSS MiB |"
             % meta["standin_capacity_lines_per_s"], "|---|---|---|---|---|---|---|"]
    for r in rows:
        label = "before (38d0fd7)" if r["label"] == "baseline" else "this change"
        lines.append(f"| {label} | {r['lines']} | {r['lines_per_s']:.0f} | {r['cpu_ms_per_line']:.3f} | "
                     f"{r['cpu_ms_per_line_first_tenth']:.3f} | {r['cpu_ms_per_line_last_tenth']:.3f} | {r['peak_rss_mib']:.0f} |")
    if "upload" in meta:
        u = meta["upload"]
        lines.append(f"\nA {u['file_mb']:.0f} MB upload (50 000 lines) and its batch: the service's RSS "
                     f"{u['rss_before_mib']:.0f} → peak {u['rss_peak_mib']:.0f} → after {u['rss_after_mib']:.0f} MiB.")
    return "\n".join(lines)


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
