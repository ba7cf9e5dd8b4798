"""Where vLLM's engine core spends its core: py-spy's samples of it during each capacity level of the harvest benchmark
(``harvest.py --py-spy``), and their summary. The engine core is one Python process that runs one core flat out on an
H200 with the small test model, and the same process at the same load generated a third to a half more tokens per
second in one pass than in another minutes apart (an H200, 2026-12-03): its stacks in a slow pass and a fast one say
what the difference is made of. py-spy reads the process's memory without pausing it (``--nonblocking``); where it is
not installed, or may not read the process (ptrace), the level runs unprofiled and the reason is kept beside the
samples (``<phase>.err``). Read: only the engine core of the vLLM server at the benchmark's URL, tagged
``TIMESLICE_TENANT=1`` and of this user, as ``pin.py`` finds it.

    python benchmarks/engine_profile.py harvest-out/pyspy  # a table per recording (.txt or .txt.gz): threads, then functions
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

from pin import server

_THREAD = re.compile(r"^thread \((\d+)\): ")


def engine_core_pid(url: str) -> int | None:
    """The engine core of the tagged vLLM server listening on ``url``'s port (this user's), None when there is none."""
    port = urlsplit(url).port
    if port is None:
        return None
    try:
        family = server(port, os.getuid())
    except SystemExit:  # pin.py's word for "no tagged vLLM listens there"
        return None
    return next((pid for pid, role in family.items() if role == "engine_core"), None)


def record(out: Path, phase: str, url: str) -> subprocess.Popen[bytes] | None:
    """py-spy on the engine core of the vLLM server at ``url``, in the background until :func:`finish`, its raw stacks
    (one thread each) to ``out/<phase>.txt``; None (the reason in ``out/<phase>.err``) when there is no py-spy or no
    such engine core."""
    out.mkdir(parents=True, exist_ok=True)
    name = phase.replace("/", "-")
    spy, pid = shutil.which("py-spy"), engine_core_pid(url)
    if spy is None or pid is None:
        (out / f"{name}.err").write_text("no py-spy on PATH\n" if spy is None else
                                         f"no engine core of a tagged vLLM server at {url}\n")
        return None
    with (out / f"{name}.err").open("wb") as err:
        return subprocess.Popen([spy, "record", "--nonblocking", "--threads", "--rate", "100", "--format", "raw",
                                 "--pid", str(pid), "--output", str(out / f"{name}.txt")], stdout=err, stderr=err)


def finish(proc: subprocess.Popen[bytes] | None) -> None:
    """End a recording: py-spy writes its samples on SIGINT (as on Ctrl-C)."""
    if proc is not None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def parse(text: str) -> list[tuple[str, list[str], int]]:
    """py-spy's raw lines with ``--threads`` (``thread (TID): NAME;frame;frame;… COUNT``) as (``NAME (TID)``, frames
    outermost first, samples); a line without the thread's mark is all frames, of thread ``""``."""
    out = []
    for line in text.splitlines():
        stacks, _, count = line.rpartition(" ")
        if not stacks or not count.isdigit():
            continue
        m = _THREAD.match(stacks)
        if m:
            name, *frames = stacks[m.end():].split(";")
            out.append((f"{name} ({m.group(1)})", frames, int(count)))
        else:
            out.append(("", stacks.split(";"), int(count)))
    return out


def load(path: Path) -> list[tuple[str, list[str], int]]:
    """A recording's stacks (:func:`parse`), as written (``.txt``) or as committed (``.txt.gz``)."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return parse(f.read())
    return parse(path.read_text())


def phase_of(path: Path) -> str:
    """The phase a recording is named after (``mix-48-capacity-512.txt.gz`` → ``mix-48-capacity-512``)."""
    return path.name.removesuffix(".gz").removesuffix(".txt")


def function(frame: str) -> str:
    """A frame's function without its line (``_process_input_queue (vllm/v1/engine/core.py:812)`` →
    ``_process_input_queue (core.py)``): one name per function, whatever line it was on."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1].split(':', 1)[0]})" if where else name


def summary(stacks: list[tuple[str, list[str], int]], top: int = 12) -> tuple[Counter[str], list[tuple[str, float]]]:
    """Samples by thread, and for the busiest thread the share of its samples in which each function is on the stack
    (counted once per stack), the ``top`` most."""
    threads: Counter[str] = Counter()
    for thread, _, n in stacks:
        threads[thread] += n
    if not threads:
        return threads, []
    busiest = threads.most_common(1)[0][0]
    inclusive: Counter[str] = Counter()
    for thread, frames, n in stacks:
        if thread == busiest:
            for name in {function(f) for f in frames}:
                inclusive[name] += n
    total = threads[busiest]
    return threads, [(name, n / total) for name, n in inclusive.most_common(top)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    for path in sorted([*args.folder.glob("*.txt"), *args.folder.glob("*.txt.gz")]):
        threads, functions = summary(load(path), args.top)
        print(f"## {phase_of(path)}: samples by thread {dict(threads.most_common(4))}")
        for name, share in functions:
            print(f"  {share:6.1%}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
