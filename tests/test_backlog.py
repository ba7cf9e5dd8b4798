"""verl's backlog read off the trainer's thread: every read on one reader thread that lives as long as the trainer."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import threading

import pytest

from timeslice_verl.handoff.backlog import Backlog

PR_SET_PDEATHSIG = 1


def test_every_read_runs_on_one_reader_thread_that_outlives_the_read():
    threads: list[threading.Thread] = []

    def source():
        threads.append(threading.current_thread())
        return (3, 8)

    backlog = Backlog(source, timeout_s=30)
    assert [backlog.read() for _ in range(3)] == [(3, 8)] * 3
    assert len(set(threads)) == 1 and threads[0] is not threading.main_thread()
    assert threads[0].is_alive(), "the reader stays: what a source started on it keeps its thread"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_process_a_source_starts_bound_to_its_thread_survives_the_read():
    """What ``ray.init`` does when a backlog read is the process's first Ray call: the GCS and the raylet it starts
    die with the thread that forked them (PR_SET_PDEATHSIG); a thread per read killed them as the read returned."""
    libc = ctypes.CDLL(None, use_errno=True)
    started: list[subprocess.Popen] = []

    def source():
        if not started:
            started.append(subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                                            preexec_fn=lambda: libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)))
        return (0, 1)

    backlog = Backlog(source, timeout_s=30)
    try:
        assert backlog.read() == (0, 1) and backlog.read() == (0, 1)  # the second read: the first one's thread is done
        assert started[0].poll() is None, "the child the first read started is alive"
    finally:
        started[0].kill()
        started[0].wait(30)
