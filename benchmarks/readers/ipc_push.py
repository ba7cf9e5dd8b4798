"""The ipc-push experiment's tables, for any of its runs: the same-GPU CUDA IPC weight push of checkpoint engine
``timeslice_ipc`` (``benchmarks/ipc_push.py``, which prints them as markdown) and the GPU tests' outcome."""

from __future__ import annotations

from typing import Callable

from readers.common import Run


def push(run: Run) -> str:
    """The big push against the GPU's copy rate, then the many updates with each process's memory."""
    return "\n".join(line for line in (run.data / "ipc_push.txt").read_text().splitlines() if line.startswith("|")
                     or not line.strip()).strip()


def tests(run: Run) -> str:
    """Each GPU test of the engine and its outcome."""
    out, name = ["| test | outcome |", "|---|---|"], None
    for line in (run.data / "gpu_tests.log").read_text().splitlines():
        if "::test_" in line and not line.startswith(("PASSED", "FAILED")):
            name = line.split("::")[1].split()[0]  # -s: the test's own print may stand between its name and outcome
        for outcome in ("PASSED", "FAILED"):
            if name and line.rstrip().endswith(outcome) and not line.startswith(outcome):
                out.append(f"| {name} | {outcome.lower()} |")
                name = None
    return "\n".join(out)


def tables(run: Run) -> dict[str, Callable[[Run], str]]:
    return {"push": push, "tests": tests}
