"""The validated run's helpers: the reward a random model can earn, and the learning-curve plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "verl_run"))

import curves  # noqa: E402
import reward  # noqa: E402


@pytest.mark.parametrize(
    ("response", "score"),
    [("", 0.0), ("abcd", 0.0), ("a1b2", 0.5), ("2026", 1.0), ("#### 42\n", 0.25)],
)
def test_reward_is_the_share_of_digits(response, score):
    assert reward.compute_score("openai/gsm8k", response, "42") == pytest.approx(score)


def test_random_responses_get_different_rewards():
    """GRPO needs rewards that differ within a group, or every advantage is 0."""
    group = ["x9 q", "zz zz", "7 7 7", "id_3"]
    assert len({reward.compute_score("openai/gsm8k", r, "") for r in group}) > 1


def _log(path: Path, steps: dict[int, tuple[float, float]]) -> None:
    path.mkdir()
    lines = ["(FullyAsyncTrainer pid=1) some other line"]
    lines += [f"step:{n} - actor/grad_norm:{g} - critic/score/mean:{s} - timing_s/step:1.0" for n, (s, g) in steps.items()]
    (path / "verl.log").write_text("\n".join(lines) + "\n")


def test_curves_of_two_runs_in_one_plot(tmp_path):
    _log(tmp_path / "solo", {1: (0.1, 0.5), 2: (0.2, 0.4)})
    _log(tmp_path / "interleave", {1: (0.1, 0.6), 2: (0.25, 0.3), 3: (0.3, 0.2)})
    out = tmp_path / "curves.png"
    curves.plot(out, [tmp_path / "solo", tmp_path / "interleave"])
    assert out.stat().st_size > 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["solo"]["critic/score/mean"] == [[1, 0.1], [2, 0.2]]
    assert data["interleave"]["actor/grad_norm"] == [[1, 0.6], [2, 0.3], [3, 0.2]]


@pytest.mark.verl
@pytest.mark.parametrize("trainer", ["fully_async", "v1"])
def test_run_sh_hands_verl_a_config_it_composes_and_the_preflight_accepts(tmp_path, monkeypatch, trainer):
    """run.sh's verl command line, for either trainer, is one verl's own Hydra config takes, with the
    interleave section and the learnable reward; captured by a stand-in interpreter that records its argv."""
    pytest.importorskip("verl")
    import os
    import shlex
    import subprocess

    from timeslice_verl.adapters.preflight import preflight

    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {shlex.quote(str(calls))}\n")
    fake.chmod(0o755)
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHON=str(fake), MODEL=str(tmp_path / "model"), DATA=str(tmp_path / "data"),
               OUT=str(tmp_path / "out"), TRAINER=trainer, RESPONSE_LEN="1024", REWARD="benchmarks/verl_run/reward.py")
    subprocess.run(["bash", "benchmarks/verl_run/run.sh", "interleave"], cwd=root, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    entry = {"fully_async": "verl.experimental.fully_async_policy.fully_async_main", "v1": "verl.trainer.main_ppo"}[trainer]
    line = next(c for c in calls.read_text().splitlines() if c.startswith(f"-m {entry} "))
    overrides = line.split()[2:]  # run.sh passes no value with a space in it
    if trainer == "v1":
        import v1_harness as harness
    else:
        import verl_harness as harness
    cfg = harness.compose(overrides)
    preflight(cfg, v1=trainer == "v1")
    assert cfg.timeslice.enabled and cfg.data.max_response_length == 1024
    assert cfg.reward.custom_reward_function.path == str(root / "benchmarks" / "verl_run" / "reward.py")
    assert cfg.actor_rollout_ref.rollout.max_model_len == 256 + 1024
