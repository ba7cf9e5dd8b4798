"""The harvest's robustness matrix: harvest.py's time-sliced row over a covering design of valley shapes, one command.

The rows (``benchmarks/harvest_design.py``: valley length × train phase × arrival mix × completion length, seeds
spread) run in order of completion length; each length has one batch input and a capacity bracket — harvest.py's
client at ``--levels`` before the length's rows and again after them, the reference of each row the best steady level
of both (``--bracket``'s reading). A row is the demo's trainer solo and time-sliced on the row's schedule, scored as
harvest.py scores its rows (the tokens vLLM generated inside the lent valleys, its own counter), plus the lines the
yields cut (the batch's ``cuts``) and the feeder's ``resumed`` / ``kept``.

A matrix outlasts one call of a GPU machine: each row is written as ``row-<factors>.json`` when it ends, and a run
into the same ``--out`` skips the rows (and capacity passes) already there; ``--budget-s`` starts no row whose estimate
(steps × (valley + train) × 2 plus each run's start) does not fit what is left. Every run ends by writing
``matrix.json`` (every row of the design, done or not) and printing its table; ``--record`` packs ``--out``.

    python benchmarks/harvest_matrix.py --design                                      # the design and its cost
    python benchmarks/harvest_matrix.py --out /root/harvest/matrix --vllm-url http://127.0.0.1:8000 --device cuda \\
        --gib 18 --capacity-s 10 --budget-s 520                                       # a GPU call; again to resume
    python benchmarks/harvest_matrix.py --out /tmp/matrix --lines 200 --steps 2 --matrix-rows 3   # CPU, the stand-in
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harvest import Sampler, _wait, capacity  # noqa: E402
from harvest_design import (LENGTHS, MatrixRow, calls, capacity_estimate_s, capacity_path, design,  # noqa: E402
                            design_table, fits, pending, reduced, row_path, summary, summary_table, total_estimate_s)
from harvest_score import LEFT_OUT, phase_generated, steady_best, valley_figures, valley_tokens  # noqa: E402
from readers.common import add_record_arguments, record as record_run  # noqa: E402
from valleys import row as valley_row  # noqa: E402

from timeslice_verl.batch.client import served_model  # noqa: E402
from timeslice_verl.demo.batch import write_input  # noqa: E402
from timeslice_verl.demo.procs import free_port  # noqa: E402
from timeslice_verl.demo.run import DemoOptions, run_demo  # noqa: E402

log = logging.getLogger("timeslice.benchmarks.matrix")


def cut_tries(db: Path) -> int | None:
    """Tries of the batch's lines a yield cut (the batch's ``cuts``), from the service's database once it stopped."""
    if not db.exists():
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            return int(conn.execute("SELECT COALESCE(SUM(cuts), 0) FROM batches").fetchone()[0])
    except sqlite3.Error as exc:
        log.warning("matrix: no cut count from %s: %s", db, exc)
        return None


def run_row(args: argparse.Namespace, url: str, row: MatrixRow, best: float, sampler: Sampler) -> dict[str, Any]:
    """One row: the trainer solo, then time-sliced beside the batch, scored over ``best``; its file written last (by
    a rename), so a row a call's end cut off has none and runs again from its start."""
    folder = args.out / "rows" / row.name
    shutil.rmtree(folder, ignore_errors=True)
    base = DemoOptions(steps=row.steps, rollout_s=row.valley_s, train_s=row.train_s, device=args.device, gib=args.gib,
                       vllm_url=url, clients=args.start_inflight, seed=row.seed, batch_lines=args.lines,
                       max_tokens=row.length, profile=row.mix.value)
    sampler.phase = f"solo-{row.name}"
    solo = run_demo(replace(base, out=folder / "solo", solo=True))
    phase = sampler.phase = f"timesliced-{row.name}"
    shared = run_demo(replace(base, out=folder / "auto"))
    sampler.phase = "between"
    r = valley_row(solo, shared, row.mix.value, "auto")
    batch = shared.get("batch") or {}
    idle_s = shared["wall_s"] * shared["trainer_idle_fraction"] if "trainer_idle_fraction" in shared else None
    r.update({**row.factors(), "mix_tokens": row.length, "batch_tokens": batch.get("tokens") or 0,
              "tenant_gpu_s": batch.get("tenant_gpu_s"), "trainer_idle_s": idle_s, "vllm_s": shared["seconds"]["vLLM"],
              "capacity_tokens_per_s": best, "lost": batch.get("lost"), "twice": batch.get("twice"),
              "feeder": batch.get("feeder"), "cut_tries": cut_tries(folder / "auto" / "batch-state" / "batch.sqlite"),
              "valleys": valley_tokens(folder / "auto" / "run.jsonl", args.out / "inflight.jsonl", phase),
              "generated_tokens": phase_generated(args.out / "inflight.jsonl", phase)})
    r.update(valley_figures(r))
    path = row_path(args.out, row)
    path.with_suffix(".tmp").write_text(json.dumps(r, indent=1) + "\n")
    path.with_suffix(".tmp").rename(path)
    return r


def capacity_pass(args: argparse.Namespace, url: str, input_path: Path, length: int, when: str,
                  sampler: Sampler) -> float:
    """harvest.py's capacity client at ``--levels`` for one length, kept as ``capacity-<length>-<when>.json``."""
    levels = [int(x) for x in args.levels.split(",")]
    got = capacity(url, input_path, args.capacity_per_level, levels, sampler, seconds=args.capacity_s, mix=length,
                   after="after-" if when == "after" else "")
    capacity_path(args.out, length, when).write_text(json.dumps(got, indent=1) + "\n")
    return steady_best(got)


def run_length(args: argparse.Namespace, url: str, rows: list[MatrixRow], sampler: Sampler, deadline: float) -> bool:
    """One completion length's rows still to do, between its two capacity passes; False where the budget ran out."""
    length, levels = rows[0].length, args.levels.split(",")
    todo = pending(args.out, rows)
    before, after = capacity_path(args.out, length, "before"), capacity_path(args.out, length, "after")
    if not todo and after.exists():
        return True
    path = write_input(args.out / f"input-{length}.jsonl", args.lines, served_model(url), length)
    try:
        best = json.loads(before.read_text()) if before.exists() else None
        best = steady_best(best) if best is not None else capacity_pass(args, url, path, length, "before", sampler)
        for row in todo:
            if not fits([row], deadline - time.monotonic()):
                print(json.dumps({"left_for_the_next_call": row.name}), flush=True)
                return False
            got = run_row(args, url, row, best, sampler)
            print(json.dumps({"row": row.name, "serving_vs_capacity": got["serving_vs_capacity"],
                              "idle_vs_capacity": got["idle_vs_capacity"], "step_ratio": got["step_ratio"]}), flush=True)
        if deadline - time.monotonic() < capacity_estimate_s(levels, args.capacity_s):
            return False
        capacity_pass(args, url, path, length, "after", sampler)
        return True
    finally:
        path.unlink(missing_ok=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="the matrix's folder (a second run into it resumes)")
    ap.add_argument("--design", action="store_true", help="print the design and its estimate, run nothing")
    ap.add_argument("--matrix-rows", type=int, default=0, help="this many rows spread over the design (0: all)")
    ap.add_argument("--steps", type=int, default=8, help="trainer steps of each row's runs")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="completion lengths, tokens")
    ap.add_argument("--budget-s", type=float, default=0.0, help="start no row or pass past this many seconds "
                    "from now (0: no limit): a call of a GPU machine that ends before its limit")
    ap.add_argument("--call-s", type=float, default=500.0, help="a call's usable seconds, for the estimate of calls "
                    "(harvest_h200.sh matrix: a call of 590 s less its margins)")
    ap.add_argument("--vllm-url", default="", help="the tenant (default: a stand-in started here, CPU)")
    ap.add_argument("--lines", type=int, default=20000, help="each length's batch")
    ap.add_argument("--capacity-per-level", type=int, default=12, help="lines per request in flight, at each level")
    ap.add_argument("--levels", default="32,128,256,512")
    ap.add_argument("--capacity-s", type=float, default=0.0, help="each level kept full this long after its "
                    "first answer (0: --capacity-per-level lines per slot)")
    ap.add_argument("--start-inflight", type=int, default=256, help="the service's lines in flight at the start")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--gib", type=float, default=8.0)
    add_record_arguments(ap)
    args = ap.parse_args(argv)
    if not args.design and args.out is None:
        ap.error("--out is needed to run the matrix (or --design to print it)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rows = reduced(design(lengths=[int(x) for x in args.lengths.split(",")], steps=args.steps), args.matrix_rows)
    levels = args.levels.split(",")
    total = total_estimate_s(rows, levels, args.capacity_s)
    print(design_table(rows))
    print(f"{len(rows)} rows, about {total / 60:.0f} min with the capacity passes: "
          f"{calls(rows, levels, args.capacity_s, args.call_s)} call(s) of {args.call_s:.0f} s", flush=True)
    if args.design:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "design.json").write_text(json.dumps([r.factors() for r in rows], indent=1) + "\n")
    deadline = time.monotonic() + args.budget_s if args.budget_s > 0 else float("inf")
    url, fake = args.vllm_url.rstrip("/"), None
    if not url:
        port = free_port()
        fake = subprocess.Popen([sys.executable, "-m", "timeslice_verl.standin", "--port", str(port), "--token-s",
                                 "0.004", "--knee", "64", "--max-num-seqs", "256"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        _wait(url)
    try:
        with Sampler(url, args.out / "inflight.jsonl") as sampler:
            for length in dict.fromkeys(r.length for r in rows):
                if not run_length(args, url, [r for r in rows if r.length == length], sampler, deadline):
                    break
    finally:
        if fake is not None:
            fake.terminate()
            fake.wait(30)
        got = summary(args.out, rows)  # also when the call's limit interrupts a row: the rows done so far
        (args.out / "matrix.json").write_text(json.dumps(got, indent=1) + "\n")
        print(summary_table(got), flush=True)
    record_run(args, "harvest-matrix", [args.out], f"{got['done']} of {got['total']} rows", exclude=LEFT_OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
