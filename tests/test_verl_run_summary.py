"""The verl run's reader (benchmarks/verl_run/summarize.py): one-GPU runs and the older two-GPU ones, from small logs
in the formats verl 0.9.1, vLLM 0.24 and Ray write; and gpumem.py's roles of real processes."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "verl_run"))

import gpumem  # noqa: E402
import rates  # noqa: E402
import summarize  # noqa: E402

T0 = dt.datetime(2026, 12, 5, 10, 0, 0, tzinfo=dt.timezone.utc).timestamp()
TENANT, POLICY = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


def stats(second: int, gen: float, running: int) -> str:
    """One throughput line of verl's rollout vLLM as Ray forwards it (prefix, vLLM's local time in whole seconds)."""
    return (f"(vLLMHttpServer pid=300) INFO 12-05 10:00:{second:02d} [loggers.py:257] Engine 000: Avg prompt "
            f"throughput: 12.0 tokens/s, Avg generation throughput: {gen} tokens/s, Running: {running} reqs, "
            f"Waiting: 0 reqs, GPU KV cache usage: 1.5%, Prefix cache hit rate: 0.0%")


def transition(action: str, subject: str, start: float, end: float) -> dict:
    return {"hook": "transition", "kind": "transition", "job": "timeslice", "action": action, "subject": subject,
            "start": T0 + start, "end": T0 + end, "ok": True, "bytes": 0, "detail": "", "phases": {}, "left": 0}


def write_run(out: Path, *, log: list[str], timeline: list[dict] = (), run: dict | None = None,
              gpumem_samples: list[dict] = (), load: dict | None = None) -> Path:
    out.mkdir()
    (out / "verl.log").write_text("\n".join(log) + "\n")
    if timeline:
        (out / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timeline))
    if run is not None:
        (out / "run.json").write_text(json.dumps(run))
    if gpumem_samples:
        (out / "gpumem.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gpumem_samples))
    if load is not None:
        (out / "load.json").write_text(json.dumps(load))
    return out


def procs(**mib: int) -> list[dict]:
    return [{"pid": 100 + i, "gpu": "0", "mib": m, "role": role.replace("_", " "), "title": "x"}
            for i, (role, m) in enumerate(mib.items())]


def test_a_time_sliced_one_gpu_run_reads_with_the_rollouts_rate_beside_and_without_the_tenant(tmp_path):
    log = [
        "(TaskRunner pid=100) [ASYNC MAIN] Starting fully async PPO training...",
        stats(2, 1000.0, 16), stats(4, 1000.0, 16), stats(6, 600.0, 16), stats(8, 600.0, 16),
        stats(10, 0.0, 0),  # paused for a weight sync: not the rollout's rate
        "\x1b[36m(vLLMHttpServer pid=300)\x1b[0m \x1b[32mINFO\x1b[0m 12-05 10:00:12 [loggers.py:257] Engine 000: Avg prompt "
        "throughput: 0.0 tokens/s, Avg generation throughput: 900.0 tokens/s, Running: 8 reqs, Waiting: 0 reqs",
        "(FullyAsyncTrainer pid=200) step:1 - actor/pg_loss:0.1 - timing_s/step:10.0 - critic/score/mean:0.2",
        "(FullyAsyncTrainer pid=200) global_steps: 1 local_trigger_step: 1 trigger_parameter_sync_step: 1",
        "(FullyAsyncTrainer pid=200) step:2 - actor/pg_loss:0.2 - timing_s/step:14.0 - critic/score/mean:0.3",
        "(FullyAsyncTrainer pid=200) global_steps: 2 local_trigger_step: 1 trigger_parameter_sync_step: 1",
        "(FullyAsyncTrainer pid=200) step:2 - val-core/openai/gsm8k/reward/mean@1:0.25 - val-aux/openai/gsm8k/score/std@1:0.1",
        *(f"(DetachActorWorker pid=210) INFO:2026-12-05 10:00:{9 + v}:timeslice_ipc: version {v}, 340 tensors, "
          f"2717908992 bytes in {s} s (6 buckets) to 1 receiver(s)" for v, s in ((1, "0.5436"), (2, "0.2718"))),
    ]
    timeline = [
        {"hook": "timeslice_start", "kind": "run", "job": "timeslice", "step": 0, "time": T0 - 10, "adapter": "stock"},
        transition("tenant_yield", TENANT, -5, -4),  # started awake, put to sleep for the trainer's start
        transition("tenant_reclaim", TENANT, 4, 4.5),
        transition("tenant_reclaim", POLICY, 6, 6.2),
        transition("tenant_yield", POLICY, 7, 7.5),
        transition("tenant_yield", TENANT, 8.5, 9),
        {"hook": "timeslice_stop", "kind": "run", "job": "timeslice", "step": 3, "time": T0 + 20, "reason": "finished"},
    ]
    samples = [{"t": T0, "used_mib": {"0": 50000}, "procs": procs(trainer=20480, rollout_vLLM=9216, tenant=11264)},
               {"t": T0 + 2, "used_mib": {"0": 62000}, "procs": procs(trainer=30720, rollout_vLLM=9216, tenant=512,
                                                                    policy=7168, rollout_receiver=1024)}]
    out = write_run(tmp_path / "validate", log=log, timeline=timeline, gpumem_samples=samples,
                    run={"mode": "validate", "gpus": 1, "rc": 0, "start": T0 - 30, "utc_offset": "+0000",
                         "stats_interval_s": 2}, load={"completed": 100, "tokens": 6400, "failed": 0, "lost": 0})
    (out / "copy_rate.json").write_text(json.dumps({"bytes_per_s": 1.5e12}))
    row = summarize.row(out)
    assert (row["gpus"], row["steps"], row["step_s_mean"]) == (1, 2, 12.0)
    assert row["rollout_tok_s_tenant_asleep"] == pytest.approx(966.7) and row["rollout_tok_s_tenant_awake"] == 600.0
    assert row["rollout_windows"] == [3, 2]
    assert row["validation"] == [[2, 0.25]] and row["tenant_tokens"] == 6400 and row["tenant_wakes"] == 2
    assert row["tenant_awake_s"] == pytest.approx(4.0 + 5.0)  # 4.5 → 8.5, and from the start to the first yield
    assert row["memory_gib"]["trainer"] == {"peak_gib": 30.0, "median_gib": 25.0}
    assert list(row["memory_gib"]) == ["trainer", "rollout vLLM", "rollout receiver", "tenant", "policy"]
    assert row["gpu_peak_gib"] == pytest.approx(62000 / 1024, abs=0.01)
    table = summarize.brief([row])
    assert "| rollout tokens/s, tenant awake | 600.0 |" in table and "| validation (step: score) | 2: 0.25 |" in table
    assert "trainer 30.0, rollout vLLM 9.0" in table
    assert row["pushes"] == [[1, 2717908992, 0.5436], [2, 2717908992, 0.2718]]
    assert (row["pushed_gb"], row["push_gb_s_median"], row["copy_gb_s"]) == (2.718, 7.5, 1500.0)
    assert row["push_of_copy"] == 0.005 and "| push / copy_ | 0.005 |" in table
    before = {k: v for k, v in row.items() if k not in summarize.MEASURED_LATER}  # a run recorded before pushes were
    assert "push / copy_" not in summarize.brief([before])
    assert "| push / copy_ | – | 0.005 |" in summarize.brief([before, row])


def test_a_two_gpu_run_without_the_newer_files_reads_as_before(tmp_path):
    log = ["(FullyAsyncTrainer pid=2) step:1 - actor/pg_loss:0.0 - timing_s/step:3.5",
           "(FullyAsyncTrainer pid=2) global_steps: 1 local_trigger_step: 1"]
    timeline = [transition("freeze", "timeslice", 1, 1.5), transition("thaw", "timeslice", 3, 3.25),
                {"hook": "timeslice_start", "kind": "run", "job": "timeslice", "step": 0, "time": T0}]
    out = write_run(tmp_path / "interleave", log=log, timeline=timeline, run={"mode": "interleave", "rc": 0, "wall_s": 300})
    row = summarize.row(out)
    assert (row["gpus"], row["steps"], row["step_s_median"], row["freezes"]) == (2, 1, 3.5, 1)
    assert row["rollout_tok_s"] is None and row["memory_gib"] is None and row["gpu_peak_gib"] is None
    assert row["validation"] is None and row["tenant_awake_s"] is None
    assert "| interleave | 1 | 3.5 |" in summarize.table([row])
    assert "| rollout tokens/s, tenant asleep | – |" in summarize.brief([row])


def test_vllm_local_times_convert_with_the_runs_utc_offset():
    line = stats(2, 10.0, 1)
    (utc,) = rates.stats_lines(line, 2026, rates.offset("+0000"))
    (cet,) = rates.stats_lines(line, 2026, rates.offset("+0100"))
    assert utc["t"] - cet["t"] == 3600 and utc["t"] == T0 + 2.5
    assert rates.offset("garbage") is dt.timezone.utc


def _start(argv: list[str], **env: str) -> tuple[subprocess.Popen, list[int]]:
    """A real process; it prints the pids it wants known once its title is in place, then waits for stdin to close."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, **env))
    pids = [int(p) for p in proc.stdout.readline().split()]
    return proc, pids


GRANDCHILD = (f"import subprocess, sys; c = subprocess.Popen(['{sys.executable}', '-c', 'import sys; print(flush=True); "
              "sys.stdin.read()'], stdin=subprocess.PIPE, stdout=subprocess.PIPE); c.stdout.readline(); "
              "print(c.pid, flush=True); sys.stdin.read(); c.stdin.close(); c.wait()")
"""A child that starts a grandchild and names it once the grandchild runs its own program (its environment and title
are then its own); the child's sys.executable is gone once ``exec -a`` renamed it, so the path is given."""


UNTAGGED = GRANDCHILD.replace("stdout=subprocess.PIPE)", "stdout=subprocess.PIPE, env={k: v for k, v in "
                              f"__import__('os').environ.items() if k != '{gpumem.ROLE_ENV}'}})")
"""The same, its grandchild's environment without the tag (as vLLM's engine core reads once it set its title)."""


@pytest.mark.parametrize("title, env, role, code", [
    ("ray::WorkerDict.actor_update_actor", {}, "trainer", GRANDCHILD),
    ("ray::vLLMHttpServer", {}, "rollout vLLM", GRANDCHILD),
    ("python3", {gpumem.ROLE_ENV: "tenant"}, "tenant", GRANDCHILD),
    ("python3", {gpumem.ROLE_ENV: "policy"}, "policy", UNTAGGED),
    ("python3", {}, "other", GRANDCHILD),
])
def test_a_gpu_process_gets_its_role_from_an_ancestors_title_or_its_tag(title, env, role, code):
    """vLLM's workers hold the memory two levels below the Ray actor that names them, or below the tagged server."""
    proc, (grandchild,) = _start(["bash", "-c", f'exec -a "{title}" {sys.executable} -c "{code}"'], **env)
    try:
        assert gpumem.role_of(grandchild) == role
        assert gpumem.role_of(proc.pid) == role
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def test_verls_own_validation_metrics_read_through_their_numpy_wrapping():
    """verl's rollouter logs its validation as ``np.float64(…)`` (the solo run's curve); our plugin's as plain floats."""
    log = ("(FullyAsyncTrainer pid=1) step:2 - rollouter/validate_time:9.47 - "
           "val-aux/openai/gsm8k/reward/mean@1:np.float64(0.02459624281618744) - "
           "val-core/openai/gsm8k/acc/mean@1:np.float64(0.024596242604191992) - val-aux/num_turns/min:np.int32(2)\n"
           "(FullyAsyncTrainer pid=1) step:4 - val-core/openai/gsm8k/reward/mean@1:0.0259 - timeslice/validate/version:4")
    steps = summarize.verl_steps(log)
    assert steps[2]["val-aux/num_turns/min"] == 2.0 and steps[2]["rollouter/validate_time"] == 9.47
    assert summarize.validation(steps) == [[2, 0.0246], [4, 0.0259]]
