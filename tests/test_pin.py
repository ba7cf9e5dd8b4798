"""benchmarks/pin.py: vLLM's engine core given a physical core of its own for the harvest benchmark — which CPUs go
where, and that only the server on the named port (this user's, tagged for the job) is touched."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
_spec = importlib.util.spec_from_file_location("pin", BENCH / "pin.py")
assert _spec is not None and _spec.loader is not None
pin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pin)

# A stand-in vLLM server: its front end (a command line naming `vllm serve`) listens on a free port, prints it and
# starts an engine core (a process named VLLM::EngineCore, spelt in two parts so that the front end's own command line
# does not read as one; untagged: what a tagged server starts is its own); both end when their stdin closes.
SERVER = """
import os, socket, subprocess, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
env = {k: v for k, v in os.environ.items() if k != "TIMESLICE_TENANT"}  # started by the tagged server: enough
engine = subprocess.Popen(["bash", "-c", "exec -a VLLM::Engine" + "Core cat"], stdin=subprocess.PIPE, env=env)
print(s.getsockname()[1], engine.pid, flush=True)
sys.stdin.read(); engine.stdin.close(); engine.wait()
"""


@pytest.mark.parametrize("cpus, mates, engine, others", [
    (list(range(16)), {15: [7], 7: [15]}, [7, 15], [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14]),
    (list(range(4)), {}, [2, 3], [0, 1]),  # no SMT: the last two, the busy loop and its helper threads
    (list(range(3)), {}, [2], [0, 1]),  # too few for two: the last alone
    ([0, 1], {}, [1], [0]),
    ([2, 5, 9], {9: [3]}, [9], [2, 5]),  # a mate this job may not use stays out of both
    ([0, 1, 2, 3, 4], {4: [9]}, [3, 4], [0, 1, 2]),  # its mate not usable: as without SMT
    # measured (cpumates.py): the last CPU's mate is outside this guest, a pair inside it is a whole core
    (list(range(16)), {3: [11], 11: [3]}, [3, 11], [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15]),
    (list(range(8)), {1: [5], 5: [1], 2: [6], 6: [2]}, [2, 6], [0, 1, 3, 4, 5, 7]),  # the last pair
])
def test_the_engine_core_gets_the_last_cpus_physical_core(cpus, mates, engine, others):
    assert pin.plan(cpus, mates) == (engine, others)


@pytest.mark.parametrize("cpus, mates, error", [
    ([], {}, "no CPU"),
    ([0, 1], {1: [0]}, "none left for the rest"),
    ([0], {}, "none left for the rest"),
])
def test_a_plan_that_leaves_nothing_for_the_rest_is_refused(cpus, mates, error):
    with pytest.raises(ValueError, match=error):
        pin.plan(cpus, mates)


def _server(tagged: bool) -> tuple[subprocess.Popen, int, int]:
    env = dict(os.environ, TIMESLICE_TENANT="1") if tagged else {k: v for k, v in os.environ.items()
                                                                  if k != "TIMESLICE_TENANT"}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, "vllm", "serve"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    port, engine = (int(x) for x in proc.stdout.readline().split())
    return proc, port, engine


def test_pins_only_the_tagged_server_on_the_port():
    try:
        engine_cpus, others = pin.current_plan()
    except ValueError:
        pytest.skip("this host's CPUs are one physical core: nothing to pin apart (pin.py says so and stops)")
    servers = [_server(tagged=True), _server(tagged=True), _server(tagged=False)]
    try:
        (_, port, engine), (other, _, other_engine), (_, untagged_port, _) = servers
        before = {p: psutil.Process(p).cpu_affinity() for p in (other.pid, other_engine)}
        got = pin.pin(port)
        assert got["engine_cpus"] == engine_cpus and got["others"] == others
        assert got["pinned"] == {servers[0][0].pid: "api_server", engine: "engine_core"}
        assert psutil.Process(engine).cpu_affinity() == engine_cpus
        assert psutil.Process(servers[0][0].pid).cpu_affinity() == others
        assert {p: psutil.Process(p).cpu_affinity() for p in before} == before  # another server: left alone
        with pytest.raises(SystemExit, match=f"listens on port {untagged_port}"):  # not tagged: not ours to touch
            pin.pin(untagged_port)
        every = sorted({*engine_cpus, *others})
        assert pin.pin(port, unpin=True)["engine_cpus"] == every
        assert psutil.Process(engine).cpu_affinity() == every == psutil.Process(servers[0][0].pid).cpu_affinity()
    finally:
        for proc, _, _ in servers:
            proc.stdin.close()
            proc.wait(timeout=60)


def test_off_runs_a_command_on_the_cpus_off_the_engine_cores():
    try:
        _, others = pin.current_plan()
    except ValueError:
        pytest.skip("this host's CPUs are one physical core: nothing to pin apart (pin.py says so and stops)")
    out = subprocess.run([sys.executable, str(BENCH / "pin.py"), "--off", sys.executable, "-c",
                          "import os; print(sorted(os.sched_getaffinity(0)))"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(others)


@pytest.mark.parametrize("argv, error", [(["--port"], "unknown arguments"), (["--port", "x"], "unknown arguments"),
                                         (["--unpin", "--port"], "unknown arguments"), (["--off"], "name the command")])
def test_bad_arguments_are_named(argv, error):
    with pytest.raises(SystemExit, match=error):
        pin.main(argv)
