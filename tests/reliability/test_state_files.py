"""Corrupt state files: the agent starts anyway, moves the file aside, and thaws what it may have frozen."""

from __future__ import annotations

import json
import os
import signal

import pytest

from agent_support import AgentProc, eventually, spawn_worker, stopped
from timeslice_verl.agent import procfs

VALID_JOB = {"name": "j", "state": "RUNNING", "procs": [], "registered": [], "holding": False}

CORRUPT = {
    "top-level-list": "[]",
    "top-level-null": "null",
    "top-level-number": "42",
    "tenant-list": json.dumps({"version": 1, "jobs": [], "tenant": ["http://127.0.0.1:9"]}),
    "tenant-string": json.dumps({"version": 1, "jobs": [], "tenant": "http://127.0.0.1:9"}),
    "tenant-bad-url": json.dumps({"version": 1, "jobs": [], "tenant": {"url": "localhost", "state": "asleep"}}),
    "tenant-urls-string": json.dumps({"version": 1, "jobs": [], "tenant": {"urls": "http://127.0.0.1:9", "state": "asleep"}}),
    "tenant-urls-twice": json.dumps({"version": 1, "jobs": [], "tenant": {"urls": ["http://127.0.0.1:9", "http://localhost:9"],
                                                                          "state": "asleep"}}),
    "deep-nesting": "[" * 5000 + "]" * 5000,
    "future-version": json.dumps({"version": 999, "jobs": [VALID_JOB]}),
    "unknown-state-holding": json.dumps({"version": 1, "jobs": [{**VALID_JOB, "state": "PARKED", "holding": True}]}),
    "v-true": json.dumps({"version": True, "jobs": []}),
    "kept-not-a-list": json.dumps({"version": 1, "jobs": [{**VALID_JOB, "kept": {"4242": 10}}]}),
    "kept-negative": json.dumps({"version": 1, "jobs": [{**VALID_JOB, "kept": [{"pid": 4242, "kept": -1}]}]}),
}


@pytest.mark.parametrize("content", CORRUPT.values(), ids=CORRUPT.keys())
def test_a_corrupt_state_file_is_moved_aside_and_the_agent_serves(tmp_path, content):
    agent = AgentProc(tmp_path)
    agent.state_file.parent.mkdir(mode=0o700, exist_ok=True)
    agent.state_file.write_text(content)
    agent.start()
    try:
        status = agent.status()
        assert status["jobs"] == [] and status["owner"] in ("none", "tenant")
        moved = list(agent.state_file.parent.glob(agent.state_file.name + ".broken-*"))
        assert moved and moved[0].read_text() == content, "the file is kept, not deleted"
        assert "is invalid" in agent.log() and "Traceback" not in agent.log()
    finally:
        agent.stop()


def test_a_truncated_state_file_still_gets_its_frozen_job_thawed(tmp_path):
    worker = spawn_worker("trunc-job")
    try:
        eventually(lambda: procfs.identify(worker.pid) is not None)
        os.kill(worker.pid, signal.SIGSTOP)  # frozen by the agent that crashed (sigstop backend)
        eventually(lambda: stopped(worker.pid))
        proc = procfs.identify(worker.pid)
        full = json.dumps({"version": 1, "jobs": [{"name": "trunc-job", "state": "FROZEN", "holding": False,
                                                   "procs": [{"pid": proc.pid, "start": proc.start}], "registered": []}]})
        agent = AgentProc(tmp_path)
        agent.state_file.parent.mkdir(mode=0o700, exist_ok=True)
        agent.state_file.write_text(full[: len(full) // 2 + 10])  # the crash cut the write short
        agent.start()
        try:
            eventually(lambda: not stopped(worker.pid), what="the salvaged job's process thawed")
            assert "jobs named in it: trunc-job" in agent.log()
        finally:
            agent.stop()
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        worker.kill()


@pytest.mark.parametrize("tenant, urls", [
    ({"urls": ["http://127.0.0.1:9", "http://127.0.0.1:10"]}, ["http://127.0.0.1:9", "http://127.0.0.1:10"]),
    ({"url": "http://127.0.0.1:9"}, ["http://127.0.0.1:9"]),  # written before the addresses were a list
    ({"url": "http://127.0.0.1:9,http://127.0.0.1:10"}, ["http://127.0.0.1:9", "http://127.0.0.1:10"]),
    ({"url": ""}, None),
])
def test_the_tenants_addresses_are_read_as_a_list_also_from_a_file_written_before(tmp_path, tenant, urls):
    from timeslice_verl.agent.state import StateStore

    path = tmp_path / "state.json"
    path.write_text(json.dumps({"version": 1, "jobs": [], "tenant": {**tenant, "state": "asleep", "sleep_level": 1}}))
    _, record, _ = StateStore(path).load()
    assert (record.urls if record else None) == urls


def test_what_a_resident_trainer_kept_survives_a_restart_of_the_agent(tmp_path):
    """A restarted agent freezes the job again by what its workers said they kept at the release: without it, a
    resident trainer read as one that kept nothing and the freeze was refused."""
    from timeslice_verl.agent.state import Job, StateStore
    from timeslice_verl.names import SwapMode

    job = Job(name="j", swap=SwapMode.resident, parked={4242: 22 << 30, 4243: 3 << 30})
    StateStore(tmp_path / "state.json").save({"j": job}, None, {})
    jobs, _, _ = StateStore(tmp_path / "state.json").load()
    assert jobs["j"].swap is SwapMode.resident and jobs["j"].parked == {4242: 22 << 30, 4243: 3 << 30}
