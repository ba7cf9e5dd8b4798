"""benchmarks/verl_run/one_gpu.sh's calls without a GPU: a run longer than its call goes on in the background, the
call says to call step 4, and step 4 waits for the run's end and packs it with the table (the run script replaced by a
stand-in that ends when the test says, so nothing here waits on time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from agent_support import eventually

REPO = Path(__file__).resolve().parents[1]
STANDIN = """#!/usr/bin/env bash
# run.sh's stand-in: its run.json and a verl log line, then it ends once the test writes $OUT/../release
mode=$1
echo "{\\"mode\\": \\"$mode\\", \\"gpus\\": 1, \\"rc\\": 0}" > "$OUT/run.json"
echo "(FullyAsyncTrainer pid=1) step:1 - actor/pg_loss:0.1 - timing_s/step:3.0" > "$OUT/verl.log"
echo "deadline=$DEADLINE_S steps=$ROLLOUT_STEPS args=$*" > "$OUT/args.txt"
while [ ! -e "$OUT/../release" ]; do sleep 0.05; done
"""


def _call(step: str, tmp: Path, budget: int, **env: str) -> subprocess.CompletedProcess:
    out = tmp / f"out-{step}"
    out.mkdir(exist_ok=True)
    environ = {**os.environ, "BASE": str(tmp / "base"), "SITE": str(tmp / "site"), "OUT": str(out),
               "RUN_SH": str(tmp / "run.sh"), "CALL_BUDGET_S": str(budget), "ORDER": "sliced",
               "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **env}
    return subprocess.run(["bash", "benchmarks/verl_run/one_gpu.sh", step], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=600)


def test_a_run_longer_than_its_call_goes_on_and_the_next_call_packs_it(tmp_path):
    (tmp_path / "run.sh").write_text(STANDIN)
    recipes = tmp_path / "base" / "recipes" / "verl"
    recipes.mkdir(parents=True)
    (recipes / "verl_env.sh").write_text("# the recipe's offline settings: none here\n")
    release = tmp_path / "base" / "runs" / "release"
    try:
        first = _call("3", tmp_path, 76, RUN_S="720")  # 1 s of this call left past the packing's share: the run outlives it
        assert first.returncode == 9, first.stdout + first.stderr
        assert "still runs: call step 4" in first.stdout
        run = tmp_path / "base" / "runs" / "solo"
        assert "deadline=720 steps=48 args=solo" in (run / "args.txt").read_text()
        assert not (run / "rc").exists(), "the run went on after its call"
    finally:
        release.touch()  # the stand-in ends whatever happened
    eventually(lambda: (run / "rc").exists(), what="the run ended")
    second = _call("4", tmp_path, 3600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "run.sh rc=0" in second.stdout and "| trainer steps |" in second.stdout
    with tarfile.open(tmp_path / "out-4" / "solo.tar.xz") as tar:
        assert "solo/run.json" in tar.getnames()
    assert json.loads((run / "run.json").read_text())["mode"] == "solo"


def test_step_4_without_a_run_says_so(tmp_path):
    recipes = tmp_path / "base" / "recipes" / "verl"
    recipes.mkdir(parents=True)
    (recipes / "verl_env.sh").write_text("")
    got = _call("4", tmp_path, 3600)
    assert got.returncode == 3 and "no run started: step 2 or 3 first" in got.stdout
