"""The multi-GPU swap benchmark's own code path, dry-run on CPU: ``torchrun`` with two ranks (FSDP2 over
gloo), one agent (CPU test backend) lending to a stand-in vLLM per "GPU", every swap mode, bit-identity
and loss checks, and the report. On the H200s the same command runs with ``--device cuda``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from agent_support import agent_with_a_tenant_per_gpu  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "swap.py"


def test_two_ranks_one_agent_a_tenant_per_gpu_every_swap_mode(tmp_path, procs):
    agent, tenants = agent_with_a_tenant_per_gpu(tmp_path, procs)
    env = {k: v for k, v in os.environ.items() if k != "TIMESLICE_JOB"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port, str(BENCH),
         "--device", "cpu", "--socket", str(agent.socket), "--job", "dry", "--tenants", ",".join(t.url for t in tenants),
         "--clients", "1", "--prepare", "no", "--cycles", "3", "--valley", "0.3", "--warmup-valley", "0.3",
         "--width", "64", "--depth", "2", "--batch", "16", "--micro", "1", "--verify", "--out", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + agent.log()[-2000:]
    ranks = json.loads((tmp_path / "out" / "swap.json").read_text())["ranks"]
    assert len(ranks) == 2 and [p["mode"] for p in ranks[0]["phases"]] == ["checkpoint", "park", "park+checkpoint"]
    rows = json.loads((tmp_path / "out" / "rows.json").read_text())
    assert all(r["losses_as_solo"] and r["bit_identical"] and r["p6"] == 0 for r in rows), rows
    # how much the tenants served in 0.3 s valleys depends on the machine's load: a benchmark figure, not a test
    assert (tmp_path / "out" / "swap.md").read_text().count("| park") == 2


@pytest.mark.slow
def test_the_valley_benchmark_compares_solo_and_interleave_on_one_schedule(tmp_path):
    """benchmarks/valleys.py (dry run): both runs on the same seeded schedule; its row is what their summaries say."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "v"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "valleys.py"), "--out", str(out), "--steps", "4",
                           "--rollout-s", "0.6", "--train-s", "0.1", "--burst-every", "2", "--device", "cpu",
                           "--clients", "2", "--batch-lines", "300"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "valleys.json").read_text())
    (run,), (row,) = result["runs"], result["rows"]
    solo, shared = run["solo"], run["interleave"]
    assert (run["profile"], run["mode"], row["profile"]) == ("even", "auto", "even")
    assert [s["wait_s"] > 0 for s in solo["steps_detail"]][:1] == [True]  # the first batch is always awaited
    assert row["steps"] == len(shared["steps_detail"]) == len(solo["steps_detail"]) == 4
    total = sum(s["step_s"] for s in shared["steps_detail"]) / sum(s["step_s"] for s in solo["steps_detail"])
    assert row["step_ratio"] == pytest.approx(total, abs=1e-3), "the summed steps of one seeded schedule, paired"
    assert row["step_ratio_median"] == pytest.approx(shared["step_s_median"] / solo["step_s_median"], abs=1e-3)
    assert row["skipped"] == shared["handoffs"]["skip"] >= 1
    # how many lent valleys came out shorter than their round trip depends on the machine's load: the row says what
    # the time-sliced run's summary says, and never more than it lent
    assert row["below_break_even"] == shared["valleys"]["below_break_even"] <= shared["valleys"]["lent"]
    assert row["intact"] is True and row["batch_failed"] == 0
    assert "| steps | step s solo |" in proc.stdout and "DRY RUN" in proc.stdout
