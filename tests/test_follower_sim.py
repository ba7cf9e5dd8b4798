"""benchmarks/follower_sim.py: the service's own limit controller against a modelled vLLM, deterministic."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import follower_sim  # noqa: E402


def test_the_model_keeps_a_server_that_runs_at_most_256_full_and_reads_the_same_twice(tmp_path, capsys):
    args = ["--shapes", "bound,steep", "--lengths", "48", "--valleys", "4", "--steps", "3", "--dt", "0.02"]
    for n in (1, 2):
        assert follower_sim.main([*args, "--out", str(tmp_path / f"sim{n}.json")]) == 0
    first, second = (json.loads((tmp_path / f"sim{n}.json").read_text())["rows"] for n in (1, 2))
    assert first == second, "seeded: the same arguments give the same rows"
    bound, steep = first
    assert bound["follow"]["last_limit"] >= 256 and bound["follow_vs_capacity"] >= 0.95
    assert max(steep["capacity"], key=steep["capacity"].get) == "128", "the steep shape gives the most at its knee"
    assert "| controller, mean |" in capsys.readouterr().out


def test_a_shape_that_does_not_exist_is_named():
    with pytest.raises(SystemExit, match="--shapes: wavy is not one of rising, flat, gentle, steep, bound"):
        follower_sim.main(["--shapes", "wavy"])
