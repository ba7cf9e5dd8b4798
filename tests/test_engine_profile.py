"""benchmarks/engine_profile.py: py-spy's stacks of vLLM's engine core during a capacity level (started beside a
process named as vLLM names its engine core, stopped by SIGINT as py-spy expects) and their summary."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent_support import eventually

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the benchmarks import their siblings by name

import engine_profile

RAW = textwrap.dedent("""\
    thread (11): MainThread;EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py:800);EngineCore.step (vllm/v1/engine/core.py:300);Scheduler.schedule (vllm/v1/core/sched/scheduler.py:200) 60
    thread (11): MainThread;EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py:800);EngineCore.step (vllm/v1/engine/core.py:310) 20
    thread (11): MainThread;EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py:805);EngineCoreProc._process_input_queue (vllm/v1/engine/core.py:812) 20
    thread (12): Thread-2 (process_output_sockets);EngineCoreProc.process_output_sockets (vllm/v1/engine/core.py:900);encode (vllm/v1/serial_utils.py:80) 30
    garbage without a count
""")


@pytest.mark.parametrize("frame, name", [
    ("EngineCore.step (vllm/v1/engine/core.py:300)", "EngineCore.step (core.py)"),
    ("<module> (<string>:10)", "<module> (<string>)"),
    ("bare", "bare"),
])
def test_a_frame_is_named_by_its_function_and_file_not_its_line(frame, name):
    assert engine_profile.function(frame) == name


def test_the_summary_counts_threads_and_each_function_once_per_stack_of_the_busiest():
    threads, functions = engine_profile.summary(engine_profile.parse(RAW))
    assert dict(threads) == {"MainThread (11)": 100, "Thread-2 (process_output_sockets) (12)": 30}
    shares = dict(functions)
    assert shares["EngineCoreProc.run_busy_loop (core.py)"] == 1.0, "on every stack of the busy loop, counted once"
    assert shares["EngineCore.step (core.py)"] == 0.8 and shares["Scheduler.schedule (scheduler.py)"] == 0.6
    assert "encode (serial_utils.py)" not in shares, "another thread's functions are not the busy loop's"
    assert engine_profile.summary([]) == (engine_profile.Counter(), [])


FAKE_SPY = textwrap.dedent("""\
    #!{python}
    import signal, sys, time
    args = sys.argv[1:]
    out = args[args.index("--output") + 1]
    stop = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    print("args:", " ".join(args), flush=True)
    while not stop:
        signal.pause()
    with open(out, "w") as f:
        f.write("thread (1): MainThread;run_busy_loop (core.py:1) 7\\n")
""")


LISTENER = "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); " \
           "print(s.getsockname()[1], flush=True); sys.stdin.read()"


def _engine(tagged: bool = True) -> tuple[subprocess.Popen[str], str]:
    """A stand-in engine core: named as vLLM names it, listening on a port of its own, tagged as harvest_h200.sh tags
    the tenant (or not); its URL."""
    env = {**os.environ, "TIMESLICE_TENANT": "1" if tagged else "0"}
    proc = subprocess.Popen(["bash", "-c", f'exec -a VLLM::EngineCore "{sys.executable}" -c "{LISTENER}"'],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    return proc, f"http://127.0.0.1:{proc.stdout.readline().strip()}"


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.stdin.close()
    proc.wait(timeout=60)


def test_a_level_is_recorded_from_its_start_until_finish_stops_py_spy_with_sigint(tmp_path, monkeypatch):
    """A stand-in ``py-spy`` on PATH that writes its samples only on SIGINT (as py-spy on Ctrl-C), beside a stand-in
    engine core of a tagged server: the recording is started on that process with the arguments py-spy takes, and
    :func:`finish` ends it with its samples written."""
    spy = tmp_path / "bin" / "py-spy"
    spy.parent.mkdir()
    spy.write_text(FAKE_SPY.format(python=sys.executable))
    spy.chmod(0o700)
    monkeypatch.setenv("PATH", f"{spy.parent}{os.pathsep}{os.environ['PATH']}")
    engine, url = _engine()
    try:
        proc = engine_profile.record(tmp_path / "pyspy", "mix-48/capacity-512", url)
        assert proc is not None
        err_file = tmp_path / "pyspy" / "mix-48-capacity-512.err"
        eventually(lambda: "args:" in err_file.read_text(), what="the stand-in py-spy ready for its SIGINT")
        engine_profile.finish(proc)
        assert proc.returncode == 0
        err = err_file.read_text()
        assert f"--pid {engine.pid}" in err and "--nonblocking" in err and "--format raw" in err
        text = (tmp_path / "pyspy" / "mix-48-capacity-512.txt").read_text()
        assert engine_profile.summary(engine_profile.parse(text))[0] == {"MainThread (1)": 7}
    finally:
        _stop(engine)


def test_only_the_engine_core_of_a_tagged_server_at_the_url_is_read():
    tagged, url = _engine()
    untagged, other = _engine(tagged=False)
    try:
        assert engine_profile.engine_core_pid(url) == tagged.pid
        assert engine_profile.engine_core_pid(other) is None, "not tagged for the job: not ours to read"
        assert engine_profile.engine_core_pid("http://127.0.0.1") is None, "no port: nothing"
    finally:
        _stop(tagged)
        _stop(untagged)


def test_without_py_spy_a_level_runs_unprofiled_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert engine_profile.record(tmp_path / "pyspy", "capacity-128", "http://127.0.0.1:9") is None
    assert (tmp_path / "pyspy" / "capacity-128.err").read_text() == "no py-spy on PATH\n"
    engine_profile.finish(None)


def test_a_recording_reads_the_same_written_or_committed(tmp_path):
    """``.txt`` as py-spy writes it, ``.txt.gz`` as the results folder keeps it: the same stacks, the same phase."""
    import gzip

    (tmp_path / "mix-48-capacity-512.txt").write_text(RAW)
    with gzip.open(tmp_path / "mix-48-capacity-after-512.txt.gz", "wt") as f:
        f.write(RAW)
    plain, packed = tmp_path / "mix-48-capacity-512.txt", tmp_path / "mix-48-capacity-after-512.txt.gz"
    assert engine_profile.load(plain) == engine_profile.load(packed) == engine_profile.parse(RAW)
    assert [engine_profile.phase_of(p) for p in (plain, packed)] == ["mix-48-capacity-512", "mix-48-capacity-after-512"]
