"""The tenant supervisor under an adversary: its server and the server's engine child are one
unit — stopped together on SIGTERM, never left behind by a SIGKILLed supervisor, never mistaken for another's."""

from __future__ import annotations

import os
import signal

import httpx
import psutil
import pytest

from agent_support import eventually, terminate
from batch_support import SupervisorProc, free_port

from timeslice_verl.standin.server import StandinServer


def _stats(url: str) -> dict | None:
    try:
        return httpx.get(f"{url}/_standin/stats", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def sock(tmp_path):
    return tmp_path / "run" / "agent.sock"


def test_sigterm_stops_the_server_and_its_engine_child(tmp_path, sock, procs):
    sup = SupervisorProc(tmp_path, sock, "--engine-child")
    procs.append(sup)
    seen = eventually(lambda: _stats(sup.url), what="the server answers")
    assert seen["child_pid"] and not _gone(seen["child_pid"])
    sup.proc.send_signal(signal.SIGTERM)
    assert sup.proc.wait(120) == 0
    assert _gone(seen["pid"]) and _gone(seen["child_pid"]), "the supervisor left part of its tenant running"


def test_a_sigkilled_supervisor_leaves_no_server_and_the_next_one_stops_the_orphans_before_it_starts(tmp_path, sock, procs):
    first = SupervisorProc(tmp_path, sock, "--engine-child", name="first")
    procs.append(first)
    old = eventually(lambda: _stats(first.url), what="the first server answers")
    first.proc.kill()
    first.proc.wait(30)
    eventually(lambda: _gone(old["pid"]), what="the server ends with its supervisor (parent-death signal)")

    second = SupervisorProc(tmp_path, sock, "--engine-child", port=first.port, name="second")
    procs.append(second)
    new = eventually(lambda: (s := _stats(second.url)) and s["pid"] != old["pid"] and s, what="the second server")
    assert _gone(old["child_pid"]), "the orphaned engine child of the first supervisor still runs"
    assert "an earlier supervisor of" in second.log()
    second.stop()
    assert _gone(new["pid"]) and _gone(new["child_pid"])


def test_a_port_another_process_serves_is_refused_not_registered(tmp_path, sock, procs):
    other = StandinServer(port=free_port()).start()
    try:
        sup = SupervisorProc(tmp_path, sock, port=int(other.url.rsplit(":", 1)[1]))
        procs.append(sup)
        assert sup.proc.wait(120) == 2
        assert "did not start" in sup.log() and str(os.getpid()) in sup.log()
        assert _stats(other.url)["pid"] == os.getpid()  # untouched
    finally:
        other.stop()


def test_a_second_supervisor_for_the_same_port_refuses_and_leaves_the_first_ones_server(tmp_path, sock, procs):
    first = SupervisorProc(tmp_path, sock, name="first")
    procs.append(first)
    seen = eventually(lambda: _stats(first.url), what="the first server answers")
    second = SupervisorProc(tmp_path, sock, port=first.port, name="second")
    procs.append(second)
    assert second.proc.wait(120) == 2 and "another supervisor runs this tenant" in second.log()
    assert _stats(first.url)["pid"] == seen["pid"]


def test_a_server_that_never_answers_is_stopped_and_started_again_after_the_start_timeout(tmp_path, sock, procs):
    sup = SupervisorProc(tmp_path, sock, "--hang", "health", sup_args=("--start-timeout-s", "1"))
    procs.append(sup)
    eventually(lambda: sup.log().count("did not answer /health within") >= 2, timeout=120,
               what="two starts given up on")
    assert "not healthy within 1 s" in sup.log()
    terminate(sup.proc, 60)
    assert sup.proc.returncode == 0
    assert not [p for p in psutil.process_iter() if _tagged_for(p, sup.url)]


def _tagged_for(p: psutil.Process, url: str) -> bool:
    try:
        return p.environ().get("TIMESLICE_TENANT_SUPERVISOR") == url and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_an_agent_takes_only_the_workers_of_its_own_scope(procs):
    """The suite beside a second copy of itself: the same job name in another scope is not this run's worker."""
    import os

    from agent_support import spawn_worker
    from timeslice_verl.agent import procfs

    ours = spawn_worker("scope-probe")
    procs.append(ours)
    saved = os.environ["TIMESLICE_SCOPE"]
    os.environ["TIMESLICE_SCOPE"] = "another-copy-of-the-suite"
    try:
        theirs = spawn_worker("scope-probe")
        procs.append(theirs)
    finally:
        os.environ["TIMESLICE_SCOPE"] = saved
    assert procfs.tagged_processes("scope-probe") == [ours.pid]
