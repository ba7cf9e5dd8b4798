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
