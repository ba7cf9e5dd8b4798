"""The user-facing product: demo, timeline plot/summary, doctor, metrics, the example plugin."""

from __future__ import annotations

import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import urllib.request

import pytest

from agent_support import AgentProc, FakeVllmProc, spawn_worker
from timeslice_verl import analysis
from timeslice_verl.config.schema import PluginSettings, TimesliceSettings
from timeslice_verl.hooks.events import HandoffEvent, Transition
from timeslice_verl.hooks.manager import TimesliceManager
from timeslice_verl.plugins.metrics import MetricsPlugin
from timeslice_verl.testing import FakeTrainer, make_lifecycle

CLI = [sys.executable, "-m", "timeslice_verl"]


@pytest.mark.slow
def test_demo_skips_a_release_when_the_next_batch_is_queued_and_solo_runs_the_same_schedule(tmp_path):
    """Every 2nd batch comes 20x faster: it is queued when the step before it ends, so that release is a
    skip; no lent valley is shorter than its round trip. ``--solo`` runs the schedule with no agent."""
    args = ["--steps", "4", "--rollout-s", "0.6", "--train-s", "0.1", "--device", "cpu", "--burst-every", "2"]
    shared = subprocess.run([*CLI, "demo", "--out", str(tmp_path / "shared"), *args], capture_output=True, text=True,
                            timeout=240)
    assert shared.returncode == 0, shared.stdout[-3000:] + shared.stderr[-3000:]
    summary = json.loads((tmp_path / "shared" / "summary.json").read_text())
    skips = [json.loads(line) for line in (tmp_path / "shared" / "run.jsonl").read_text().splitlines()
             if '"skip"' in line]
    assert summary["handoffs"]["skip"] == len(skips) >= 1
    assert all(r["detail"].startswith("next batch queued") for r in skips), skips
    assert summary["valleys"]["below_break_even"] == 0 and summary["failed_transitions"] == 0
    assert summary["worker_data_intact"] is True

    solo = subprocess.run([*CLI, "demo", "--out", str(tmp_path / "solo"), *args, "--solo"], capture_output=True,
                          text=True, timeout=240)
    assert solo.returncode == 0, solo.stdout[-3000:] + solo.stderr[-3000:]
    assert "solo (the trainer keeps its GPU)" in solo.stdout
    records = [json.loads(line) for line in (tmp_path / "solo" / "run.jsonl").read_text().splitlines()]
    assert sum(r["hook"] == "pre_train_step" for r in records) == 4
    assert not any(r["hook"] in ("handoff", "transition") for r in records), "nothing is handed over in a solo run"
    assert not (tmp_path / "solo" / "agent.log").exists()


@pytest.mark.slow
def test_demo_validates_due_versions_in_the_valleys_through_a_policy_tenant_beside_the_batch_tenant(tmp_path):
    """``--validate-every 2``: a second stand-in (the policy tenant, under its own supervisor, a member of the agent's
    group) gets each due version's weights and answers the validation set as batch work; every due version is
    either validated — its metrics logged at its step with verl's keys — or reported late, never dropped."""
    pytest.importorskip("verl", reason="validation scores with verl's reward function (the 'verl' extra)")
    out = tmp_path / "demo"
    proc = subprocess.run([*CLI, "demo", "--out", str(out), "--steps", "6", "--rollout-s", "1.0", "--train-s", "0.2",
                           "--device", "cpu", "--validate-every", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    v = json.loads((out / "summary.json").read_text())["validation"]
    validated = [r["version"] for r in v["runs"] if r["status"] == "completed" and r["answers"] == 16 and not r["error"]]
    assert validated and all(version in (2, 4, 6) for version in validated), v["runs"]
    assert 6 in validated, "the last due version runs in the valley the run's end leaves"
    superseded = {x["version"] for x in v["late"] if x["superseded"]}
    assert {r["version"] for r in v["runs"]} | superseded == {2, 4, 6}, v  # every due version: run, or reported
    logged = {m["timeslice/validate/version"]: m for m in v["logged"]}
    assert sorted(logged) == sorted(validated) and all(logged[k]["step"] == k for k in logged)
    assert all("val-core/openai/gsm8k/reward/mean@1" in m for m in logged.values()), v["logged"]
    assert f"validation: {len(validated)} of {len(v['runs'])} runs" in proc.stdout
    assert "already registered" not in (out / "policy-tenant.log").read_text(), "the policy tenant joined the group"


@pytest.mark.parametrize("args, says", [
    (["--policy-url", "http://127.0.0.1:8001"], "need --validate-every"),
    (["--validate-every", "2", "--policy-model", "m"], "name the running vLLM too"),
    (["--validate-every", "-1"], "--validate-every takes a number of versions >= 0"),
])
def test_demo_refuses_validation_flags_that_do_not_go_together(tmp_path, args, says):
    proc = subprocess.run([*CLI, "demo", "--out", str(tmp_path / "d"), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "d" / "agent.log").exists()


def test_demo_refuses_a_setting_the_schema_refuses_before_starting_anything(tmp_path):
    proc = subprocess.run([*CLI, "demo", "--out", str(tmp_path / "d"), "--set", "timeslice.handoff.swap=bogus"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "timeslice.handoff.swap" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "d" / "agent.log").exists()


@pytest.mark.slow
def test_demo_dry_run_writes_a_png_and_a_summary_that_matches_its_jsonl(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [*CLI, "demo", "--out", str(out), "--steps", "5", "--rollout-s", "1.0", "--train-s", "0.3", "--device", "cpu"],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DRY RUN on CPU" in proc.stdout and "SIMULATED vLLM" in proc.stdout
    png = out / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "run.jsonl").read_text().splitlines()]

    # recomputed here straight from the JSONL, without the analysis module
    times = [r["time"] for r in records if "time" in r]
    assert summary["wall_s"] == pytest.approx(max(times) - min(times), abs=1e-3)
    assert summary["steps"] == sum(r["hook"] == "pre_train_step" for r in records) == 5
    acquires = [r for r in records if r["hook"] == "handoff" and r["action"] == "acquire"]
    assert summary["handoffs"]["acquire"] == len(acquires)
    # start-up is no valley, and a way back started ahead of the batch (point "prepare") runs in the background
    waits = [r["waited_s"] for r in acquires if r["point"] not in ("init_workers_begin", "prepare")]
    assert len(waits) == len(acquires) - 1 - sum(r["point"] == "prepare" for r in acquires)
    assert summary["trainer_wait_ms"]["p50"] == pytest.approx(statistics.median(waits) * 1e3, abs=1e-3)
    assert summary["trainer_wait_ms"]["max"] == pytest.approx(max(waits) * 1e3, abs=1e-3)
    trans = {(r["action"], r["start"]): r for r in records if r["hook"] == "transition"}
    for action in ("freeze", "thaw", "tenant_yield", "tenant_reclaim"):
        assert summary["transitions"][action] == sum(a == action for a, _ in trans)
    tenant = sorted((r for r in trans.values() if r["action"].startswith("tenant")), key=lambda r: r["start"])
    awake, on = 0.0, min(times) if tenant and tenant[0]["action"] == "tenant_yield" else None
    for r in tenant:
        if r["action"] == "tenant_yield" and on is not None:
            awake, on = awake + r["start"] - on, None
        elif r["action"] == "tenant_reclaim":
            on = r["end"]
    awake += (max(times) - on) if on is not None else 0.0
    assert summary["harvested_fraction"] == pytest.approx(awake / summary["wall_s"], abs=0.02)
    assert summary["harvested_fraction"] > 0.2, "vLLM used the valleys"
    batch = summary["batch"]
    assert batch["completed"] > 0 and batch["failed"] == batch["lost"] == batch["twice"] == 0, batch
    assert summary["worker_data_intact"] is True
    assert summary["mode"]["dry_run"] is True and summary["mode"]["backend"] == "sigstop"
    # the printed summary is the file's
    assert f"{summary['harvested_fraction'] * 100:5.1f} %" in proc.stdout


def test_timeline_plot_cli(tmp_path):
    jsonl = tmp_path / "t.jsonl"
    records = [
        {"hook": "timeslice_start", "kind": "run", "job": "j", "time": 100.0},
        {"hook": "handoff", "kind": "handoff", "job": "j", "time": 101.0, "action": "acquire", "waited_s": 0.5, "ok": True},
        {"hook": "transition", "kind": "transition", "job": "j", "action": "tenant_yield", "subject": "u", "start": 100.4, "end": 100.5, "ok": True, "bytes": 0},
        {"hook": "transition", "kind": "transition", "job": "j", "action": "thaw", "subject": "j", "start": 100.5, "end": 101.0, "ok": True, "bytes": 2**30},
        {"hook": "pre_train_step", "kind": "train_step", "job": "j", "time": 101.0},
        {"hook": "handoff", "kind": "handoff", "job": "j", "time": 103.0, "action": "release", "waited_s": 0.0, "ok": True},
        {"hook": "transition", "kind": "transition", "job": "j", "action": "freeze", "subject": "j", "start": 103.0, "end": 103.5, "ok": True, "bytes": 2**30},
        {"hook": "transition", "kind": "transition", "job": "j", "action": "tenant_reclaim", "subject": "u", "start": 103.5, "end": 104.0, "ok": True, "bytes": 0},
        {"hook": "timeslice_stop", "kind": "run", "job": "j", "time": 110.0},
    ]
    jsonl.write_text("\n".join(json.dumps(r) for r in records))
    out = subprocess.run([*CLI, "timeline", "plot", str(jsonl), "-o", str(tmp_path / "t.png"), "--json", str(tmp_path / "s.json")],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["wall_s"] == 10.0
    assert s["seconds"]["trainer"] == pytest.approx(2.0)       # 101 → 103
    assert s["seconds"]["swapping"] == pytest.approx(1.6)      # yield+thaw 100.4→101, freeze+reclaim 103→104
    assert s["seconds"]["vLLM"] == pytest.approx(0.4 + 6.0)    # 100 → 100.4 and 104 → 110
    assert s["harvested_fraction"] == pytest.approx(0.64)
    assert "vLLM harvested" in out and (tmp_path / "t.png").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    err = subprocess.run([*CLI, "timeline", "plot", str(bad)], capture_output=True, text=True, timeout=60)
    assert err.returncode != 0 and "bad.jsonl:1: not a JSON line" in err.stderr


def test_doctor_on_a_cpu_machine_fails_with_reasons(tmp_path):
    vllm = FakeVllmProc()
    agent = AgentProc(tmp_path, tenant_url=vllm.url).start()
    good = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env=dict(os.environ, TIMESLICE_JOB="doc-job", NCCL_CUMEM_ENABLE="0", NCCL_NVLS_ENABLE="0", NCCL_P2P_DISABLE="1"))
    bad_env = dict(os.environ, TIMESLICE_JOB="doc-job", NCCL_CUMEM_ENABLE="0")
    for key in ("NCCL_NVLS_ENABLE", "NCCL_P2P_DISABLE"):
        bad_env.pop(key, None)
    bad = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=bad_env)
    try:
        # the doctor's own shell has no NCCL settings: what counts is the job's processes
        env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
        proc = subprocess.run(
            [*CLI, "doctor", "timeslice.job=doc-job", f"timeslice.agent.socket={agent.socket}", f"timeslice.tenant.url={vllm.url}"],
            capture_output=True, text=True, timeout=120, env=env,
        )
    finally:
        for p in (good, bad):
            p.kill()
        agent.stop()
        vllm.stop()
    out = proc.stdout
    assert proc.returncode == 1
    lines = {line.split(" — ")[0]: line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))}
    assert lines["FAIL  driver supports CUDA checkpoint (r570+)"]
    assert lines["FAIL  NVML reachable"]
    assert f"PASS  NCCL settings of pid {good.pid} (job 'doc-job')" in lines
    bad_line = lines[f"FAIL  NCCL settings of pid {bad.pid} (job 'doc-job')"]
    assert "NCCL_NVLS_ENABLE unset" in bad_line and "NCCL_P2P_DISABLE unset" in bad_line
    assert "PASS  vLLM reachable with dev mode + sleep mode" in lines
    assert "PASS  agent socket reachable" in lines
    assert "FAIL  host RAM >= GPU bytes to freeze" in lines
    assert "fix: launch the job with +timeslice=interleave" in out
    assert "checks passed" in out.splitlines()[-1]


def test_doctor_passes_the_nccl_check_when_no_job_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    proc = subprocess.run([*CLI, "doctor", "timeslice.job=nobody-runs-this", f"timeslice.agent.socket={tmp_path}/nope.sock",
                           "timeslice.tenant.url=http://127.0.0.1:9"], capture_output=True, text=True, timeout=120, env=env)
    line = next(line for line in proc.stdout.splitlines() if "NCCL settings of job" in line)
    assert line.startswith("PASS") and "NCCL_P2P_DISABLE=1" in line


def test_doctor_without_agent_or_vllm_names_the_fixes(tmp_path):
    proc = subprocess.run([*CLI, "doctor", f"timeslice.agent.socket={tmp_path}/nope.sock", "timeslice.tenant.url=http://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "FAIL  agent socket reachable" in proc.stdout and "fix: start the agent" in proc.stdout
    assert "FAIL  vLLM reachable" in proc.stdout and "VLLM_SERVER_DEV_MODE=1" in proc.stdout


def test_doctor_checks_every_server_of_a_tenant_group(tmp_path):
    vllm = FakeVllmProc()
    try:
        proc = subprocess.run([*CLI, "doctor", f"timeslice.agent.socket={tmp_path}/nope.sock",
                               f'timeslice.tenant.urls=["{vllm.url}","http://127.0.0.1:9"]'],
                              capture_output=True, text=True, timeout=120)
    finally:
        vllm.stop()
    assert f"PASS  vLLM reachable with dev mode + sleep mode ({vllm.url})" in proc.stdout, proc.stdout
    assert "FAIL  vLLM reachable with dev mode + sleep mode (http://127.0.0.1:9)" in proc.stdout


def test_metrics_plugin_puts_handoff_figures_into_the_trainer_metrics():
    trainer = FakeTrainer()
    lc = make_lifecycle(MetricsPlugin(), trainer=trainer)
    lc.start()
    trans = (Transition("freeze", "j", 1.0, 3.0, bytes=4 * 10**9), Transition("thaw", "j", 5.0, 6.0, bytes=4 * 10**9),
             Transition("tenant_yield", "u", 4.5, 5.0))
    lc.handoff(lc.event(HandoffEvent, action="acquire", waited_s=1.6, transitions=trans))
    m = trainer.metrics
    assert m["timeslice/acquire_wait_s"] == 1.6 and m["timeslice/thaw_s"] == 1.0 and m["timeslice/freeze_s"] == 2.0
    assert m["timeslice/restore_gbps"] == 4.0 and m["timeslice/checkpoint_gbps"] == 2.0
    assert m["timeslice/tenant_yield_s"] == 0.5 and m["timeslice/handoffs"] == 1
    # a park: the workers moved the bytes, the agent only locked — no driver rate, nothing frozen by it
    lock = Transition("freeze", "j", 7.0, 7.004, bytes=2 * 10**9, phases={"lock": 0.003, "checkpoint": 0.0})
    lc.handoff(lc.event(HandoffEvent, action="release", transitions=(lock,), swap="park",
                                  parked_bytes=3 * 2**30, park_s=0.06))
    assert "timeslice/checkpoint_gbps" in m and m["timeslice/frozen_gib"] == 0.0  # the earlier rate stays, this one adds none
    assert m["timeslice/park_s"] == 0.06 and m["timeslice/parked_gib"] == 3.0


def test_agent_prometheus_endpoint(tmp_path):
    import socket as s

    with s.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = AgentProc(tmp_path, extra=(f"timeslice.agent.metrics_port={port}",)).start()
    w = spawn_worker("m-job")
    try:
        with agent.client() as c:
            c.acquire("m-job")
            c.release("m-job", wait=True)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        w.kill()
        agent.stop()
    assert 'timeslice_transitions_total{action="freeze",ok="true"} 1.0' in text
    assert 'timeslice_acquire_wait_seconds_count{job="m-job"} 1.0' in text
    assert "timeslice_gpu_owner" in text


def test_example_plugin_from_hooks_is_discovered_through_its_entry_point_and_called(tmp_path):
    names = {ep.name: ep for ep in importlib.metadata.entry_points(group="timeslice_verl")}
    if "csv" not in names:
        message = "the example plugin is not installed: pip install ./hooks/timeslice-csv"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    assert names["csv"].value == "timeslice_csv:CsvHandoffPlugin"
    settings = TimesliceSettings(job="j", plugins=PluginSettings(options={"csv": {"path": str(tmp_path / "h.csv")}}))
    manager = TimesliceManager().load(settings.plugins, bundled=())
    info = {p.name: p for p in manager.plugins()}
    assert info["csv"].source.startswith("entry point timeslice-csv 0.") and "handoff" in info["csv"].hooks
    from timeslice_verl.hooks.lifecycle import Lifecycle

    lc = Lifecycle(settings, manager, trainer=FakeTrainer())
    lc.start()
    lc.handoff(lc.event(HandoffEvent, action="acquire", point="pre_train_step", waited_s=0.01))
    lc.stop()
    assert (tmp_path / "h.csv").read_text().splitlines()[1].split(",")[4] == "acquire"
    # and it is switched off by name like any plugin
    assert TimesliceManager().load(PluginSettings(disabled=["csv"]), bundled=()).get("csv") is None


def test_analysis_rejects_empty_files(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no records"):
        analysis.load(empty)


def test_a_terminated_demo_leaves_no_process_behind(tmp_path):
    """SIGTERM (a timeout, a CI job stopped) unwinds the demo like Ctrl-C: its agent, worker and tenant go too."""
    import signal
    from pathlib import Path

    from agent_support import eventually

    out = tmp_path / "demo"
    proc = subprocess.Popen([*CLI, "demo", "--out", str(out), "--steps", "50", "--device", "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def mine() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and str(out) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    eventually(lambda: (out / "worker.log").exists() and len(mine()) >= 1, what="the demo's agent and worker run")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) != 0
    eventually(lambda: mine() == [], what="no process of the demo left")
