"""Gives vLLM's engine core a physical core of its own, for the harvest benchmark on one H200.

With a small model the engine core is a Python loop one core flat out, so its pace is its core's: on an H200
(2026-12-03) the same server read at the same running count 29 000 tokens/s in one capacity pass and 46 000 in the
next. This tests whether the threads sharing its core are why: the engine core (all its threads: its busy loop and
the threads that move its inputs and outputs) gets the last physical core (the last CPU and its SMT threads; the last
two CPUs where the host shows no SMT and has four or more), every other process of that vLLM server the rest. A VM
may hide SMT: ``PIN_MATES=FILE`` (``benchmarks/cpumates.py``'s output) adds the mates measured, and the engine core
then gets the last pair found, its mate kept free of everything else.

    python3 benchmarks/pin.py [--port 8000]    pins; prints {"engine_cpus": [...], "others": [...], "pinned": {...}}
    python3 benchmarks/pin.py --unpin [--port 8000]   gives every process of the server all the CPUs again (the
                                               same server pinned and not, side by side: harvest_h200.sh pinab)
    python3 benchmarks/pin.py --off CMD ARG…   runs CMD on the CPUs off the engine core's (harvest.py, its agent, its
                                               trainer): children keep the affinity

Touched: only the vLLM server listening on that port, tagged ``TIMESLICE_TENANT=1`` (harvest_h200.sh starts vLLM so),
and the vLLM processes it started, all of this user, and only their CPU affinity."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hostload import core_mates, vllm_role  # noqa: E402

TAG = ("TIMESLICE_TENANT", "1")


def plan(cpus: list[int], mates: dict[int, list[int]]) -> tuple[list[int], list[int]]:
    """(the engine core's CPUs, everyone else's) from the CPUs this job may use and each one's SMT mates: the last
    physical core with a mate this job may use, else the last CPU's — without SMT mates, and with four CPUs or more,
    the last two (the engine core runs one core flat out and its helper threads beside it); the rest must leave at
    least one CPU."""
    if not cpus:
        raise ValueError("no CPU to pin to")
    paired = [c for c in cpus if any(m in cpus for m in mates.get(c, []))]
    last = max(paired or cpus)  # a whole physical core where one is known, its mate kept off as well
    engine = sorted({last, *(c for c in mates.get(last, []) if c in cpus)})
    if len(engine) == 1 and len(cpus) >= 4:
        engine = sorted(cpus)[-2:]
    others = [c for c in sorted(cpus) if c not in engine]
    if not others:
        raise ValueError(f"the engine core's physical core {engine} is every CPU this job has: none left for the rest")
    return engine, others


def _ours(proc: psutil.Process, uid: int, tagged: bool = True) -> str | None:
    """The vLLM role of a process of this user (``tagged``: and tagged for the job), else None."""
    try:
        if proc.uids().real != uid or (tagged and proc.environ().get(TAG[0]) != TAG[1]):
            return None
        return vllm_role(proc.cmdline())
    except psutil.Error:  # ended meanwhile, or its environment unreadable: not ours to touch
        return None


def server(port: int, uid: int) -> dict[int, str]:
    """pid -> role of the vLLM server listening on ``port`` and the vLLM processes it started: the topmost tagged vLLM
    ancestor of the listener (this user's) and its descendants of this user (the agent's rule: a tenant's engine core
    is what its tagged server started)."""
    listening = None
    for proc in psutil.process_iter():
        if _ours(proc, uid) is None:
            continue
        try:
            sockets = (getattr(proc, "net_connections", None) or proc.connections)("tcp")  # psutil < 6: connections
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in sockets):
                listening = proc
                break
        except psutil.Error:
            continue
    if listening is None:
        raise SystemExit(f"pin.py: no vLLM process of this user tagged {TAG[0]}={TAG[1]} listens on port {port}")
    top = listening
    while (parent := top.parent()) is not None and _ours(parent, uid) is not None:
        top = parent
    family = {}
    for proc in [top, *top.children(recursive=True)]:
        role = _ours(proc, uid, tagged=False)
        if role is not None:
            family[proc.pid] = role
    return family


def current_plan() -> tuple[list[int], list[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    return plan(cpus, {c: core_mates(c) for c in cpus})


def pin(port: int, unpin: bool = False) -> dict[str, object]:
    """Pins the server on ``port`` (or, ``unpin``, gives its processes every CPU of this job again)."""
    try:
        engine, others = current_plan()
    except ValueError as exc:
        raise SystemExit(f"pin.py: {exc}") from exc
    if unpin:
        engine = others = sorted({*engine, *others})
    procs = server(port, os.getuid())
    if "engine_core" not in procs.values():
        raise SystemExit(f"pin.py: the vLLM server on port {port} has no engine core process of its own")
    for pid, role in procs.items():
        try:
            psutil.Process(pid).cpu_affinity(engine if role == "engine_core" else others)
        except psutil.Error as exc:
            raise SystemExit(f"pin.py: could not pin {role} (pid {pid}): {exc}") from exc
    return {"engine_cpus": engine, "others": others, "pinned": procs}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--off"]:
        if len(argv) < 2:
            raise SystemExit("pin.py --off: name the command to run")
        try:
            os.sched_setaffinity(0, current_plan()[1])
        except ValueError as exc:
            raise SystemExit(f"pin.py: {exc}") from exc
        os.execvp(argv[1], argv[1:])
    unpin = "--unpin" in argv
    rest = [a for a in argv if a != "--unpin"]
    if rest and (len(rest) != 2 or rest[0] != "--port" or not rest[1].isdigit()):
        raise SystemExit(f"pin.py: unknown arguments {argv}: [--unpin] [--port N], or --off CMD ARG…")
    print(json.dumps(pin(int(rest[1]) if rest else 8000, unpin)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
