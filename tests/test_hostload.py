"""benchmarks/hostload.py: what the harvest benchmark's sampler records beside vLLM's metrics (the host's CPU, vLLM's
processes' CPU by role, the GPU's clock), so that a slower server can be told from a slower feeder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import psutil
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the benchmarks import their siblings by name

import hostload

Times = namedtuple("Times", "user nice system idle iowait irq softirq steal")


@pytest.mark.parametrize("cmdline, role", [
    (["VLLM::EngineCore"], "engine_core"),
    (["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], "api_server"),
    (["/usr/bin/vllm", "serve", "m"], "api_server"),
    (["VLLM::Worker_TP0"], "worker"),
    (["VLLM::APIServer_1"], "api_server"),
    (["python3", "trainer.py", "--vllm-url", "x"], None),
    ([], None),
])
def test_a_vllm_process_is_known_by_its_command_line(cmdline, role):
    assert hostload.vllm_role(cmdline) == role


@pytest.mark.parametrize("before, after, share", [
    (Times(10, 0, 5, 80, 5, 0, 0, 0), Times(20, 0, 10, 85, 5, 0, 0, 0), 0.75),  # 15 busy of 20
    (Times(10, 0, 5, 80, 5, 0, 0, 0), Times(10, 0, 5, 90, 10, 0, 0, 0), 0.0),  # idle and iowait are not busy
    (Times(10, 0, 5, 80, 5, 0, 0, 0), Times(10, 0, 5, 80, 5, 0, 0, 0), None),  # no time passed
])
def test_the_hosts_busy_share_between_two_reads(before, after, share):
    assert hostload.busy_share(hostload.host_busy(before), hostload.host_busy(after)) == share


@pytest.mark.parametrize("before, after, shares", [
    (Times(10, 0, 5, 80, 5, 0, 0, 0), Times(20, 0, 10, 85, 5, 0, 0, 0), (0.75, 0.0)),
    (Times(10, 0, 0, 80, 0, 0, 0, 10), Times(15, 0, 0, 80, 0, 0, 0, 15), (0.5, 0.5)),  # steal is not work
    (Times(10, 0, 5, 80, 5, 0, 0, 0), Times(10, 0, 5, 80, 5, 0, 0, 0), (None, None)),  # no time passed
])
def test_a_cpus_work_and_steal_between_two_reads(before, after, shares):
    assert hostload.cpu_share(before, after) == shares


def test_a_guests_time_counted_once():
    """Linux counts a guest's time in user as well: 10 s of it inside 20 s of user is not 30 s of work."""
    Guest = namedtuple("Guest", "user nice system idle iowait irq softirq steal guest guest_nice")
    before, after = Guest(0, 0, 0, 0, 0, 0, 0, 0, 0, 0), Guest(20, 0, 0, 20, 0, 0, 0, 0, 10, 0)
    assert hostload.cpu_share(before, after) == (0.5, 0.0)


@pytest.mark.parametrize("text, cpus", [
    ("0,8\n", [0, 8]), ("0-1\n", [0, 1]), ("2-3,18-19", [2, 3, 18, 19]), ("5", [5]), ("", []),
])
def test_a_kernel_cpu_list(text, cpus):
    assert hostload.parse_cpu_list(text) == cpus


def test_core_mates_read_sysfs_and_leave_the_cpu_itself_out(tmp_path):
    for cpu, mates in ((0, "0,8"), (8, "0,8"), (3, "3")):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(mates + "\n")
    assert hostload.core_mates(0, tmp_path) == [8]
    assert hostload.core_mates(8, tmp_path) == [0]
    assert hostload.core_mates(3, tmp_path) == []
    assert hostload.core_mates(5, tmp_path) == []  # not in sysfs: unknown, none


def test_core_mates_add_the_mates_cpumates_measured(tmp_path, monkeypatch):
    (tmp_path / "cpu3" / "topology").mkdir(parents=True)
    (tmp_path / "cpu3" / "topology" / "thread_siblings_list").write_text("3\n")  # a VM: every CPU alone
    found = tmp_path / "mates.json"
    found.write_text(json.dumps({"mates": {"3": [11], "11": [3]}, "slowdown": {}}))
    monkeypatch.setenv("PIN_MATES", str(found))
    assert hostload.core_mates(3, tmp_path) == [11]
    assert hostload.core_mates(11, tmp_path) == [3]
    assert hostload.core_mates(4, tmp_path) == []
    monkeypatch.delenv("PIN_MATES")
    assert hostload.core_mates(3, tmp_path) == []


@pytest.mark.parametrize("text", ["not json", "{}", '{"mates": [1, 2]}', '{"mates": {"x": [1]}}'])
def test_a_mates_file_that_is_not_cpumates_output_is_named(tmp_path, monkeypatch, text):
    (tmp_path / "bad.json").write_text(text)
    monkeypatch.setenv("PIN_MATES", str(tmp_path / "bad.json"))
    with pytest.raises(SystemExit, match="PIN_MATES=.*bad.json: not the output of benchmarks/cpumates.py"):
        hostload.measured_mates()


def test_cores_by_role_sum_a_roles_processes_and_leave_out_one_seen_once():
    before = {1: ("api_server", 10.0), 2: ("engine_core", 5.0), 3: ("engine_core", 1.0), 4: ("worker", 0.0)}
    after = {1: ("api_server", 10.5), 2: ("engine_core", 6.0), 3: ("engine_core", 1.5), 5: ("worker", 9.0),
             4: ("api_server", 3.0)}  # pid 4 reused by another role: not counted
    assert hostload.cores_by_role(before, after, 0.5) == {"api_server": 1.0, "engine_core": 3.0}
    assert hostload.cores_by_role(before, after, 0.0) == {}


@pytest.mark.parametrize("before, after, seconds, cores", [
    ({1: 10.0, 2: 1.0, 3: 0.0}, {1: 10.9, 2: 1.05, 3: 0.0}, 1.0, [0.9, 0.05, 0.0]),
    ({1: 10.0, 2: 1.0}, {1: 10.5, 2: 1.5, 4: 7.0}, 0.5, [1.0, 1.0]),  # a thread seen once (4) is left out
    ({1: 10.0, 2: 1.0, 3: 0.0, 5: 2.0}, {1: 11.0, 2: 1.2, 3: 0.1, 5: 2.3}, 1.0, [1.0, 0.3, 0.2]),  # the three busiest
    ({1: 10.0}, {1: 11.0}, 0.0, []),  # no time passed
])
def test_the_engine_cores_threads_by_their_cpu_most_first(before, after, seconds, cores):
    assert hostload.thread_cores(before, after, seconds) == cores


def test_a_sample_finds_a_running_vllm_process_of_this_user_and_reads_only():
    """A live read on this host: a process whose command line names vLLM's API server is found and its CPU counted
    (a value, not a speed: no threshold); it is left running — the sampler never signals anything."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "vllm.entrypoints.fake"],
                             stdin=subprocess.PIPE)
    engine = subprocess.Popen(["bash", "-c", 'exec -a VLLM::EngineCore cat'], stdin=subprocess.PIPE)
    try:
        load = hostload.HostLoad(rescan=1, engine_pid=engine.pid)
        got = load.sample()
        assert set(got) == {"host_cpu", "vllm_cores", "sm_mhz", "gpu_util", "steal", "engine_cpu", "engine_cpu_steal",
                            "engine_mates_busy", "engine_threads", "cpu_speed", "cpu_rate"}
        assert got["cpu_speed"] is None and got["cpu_rate"] is None, "no CPU named: no probe"
        assert got["host_cpu"] is None or 0.0 <= got["host_cpu"] <= 1.0
        assert got["steal"] is None or 0.0 <= got["steal"] <= 1.0
        assert "api_server" in got["vllm_cores"] and got["vllm_cores"]["api_server"] >= 0.0
        assert got["engine_cpu"] in range(psutil.cpu_count())  # the stand-in engine core found, on a CPU of this host
        assert got["engine_cpu_steal"] is None or 0.0 <= got["engine_cpu_steal"] <= 1.0
        assert len(got["engine_threads"]) == 1 and got["engine_threads"][0] >= 0.0, "cat: one thread, read by id"
        assert child.poll() is None and engine.poll() is None
    finally:
        for proc in (child, engine):
            proc.stdin.close()
            proc.wait(timeout=60)


def test_a_sample_with_a_cpu_named_carries_its_pace_and_close_ends_the_probe():
    """``speed_cpu``: the probe's readings over its first come in ``cpu_speed`` once one has arrived."""
    load = hostload.HostLoad(rescan=1, speed_cpu=max(os.sched_getaffinity(0)))
    try:
        load._speed._readings.put(load._speed.next())  # one reading waits: the sample takes it (no waiting on time)
        got = load.sample()
        assert got["cpu_speed"] > 0 and load._speed.first is not None, "over the first reading taken"
        assert got["cpu_rate"] > 0
    finally:
        load.close()
    assert load._speed._proc.returncode is not None


ITL_TEXT = """# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 10.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 1.5
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0
vllm:inter_token_latency_seconds_sum{engine="1",model_name="m"} 0.5
vllm:inter_token_latency_seconds_count{engine="1",model_name="m"} 60.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


@pytest.mark.parametrize("text, want", [
    (ITL_TEXT, {"itl_sum": 2.0, "itl_count": 160.0}),  # summed over engines (and API servers)
    ("vllm:num_requests_running 3.0\n", {"itl_sum": None, "itl_count": None}),  # not reported: None, not 0
    ("vllm:inter_token_latency_seconds_sum{a=\"b\"} nan-ish\n", {"itl_sum": None, "itl_count": None}),
    ("", {"itl_sum": None, "itl_count": None}),
])
def test_vllms_step_totals_from_its_inter_token_latency(text, want):
    assert hostload.itl_totals(text) == want
