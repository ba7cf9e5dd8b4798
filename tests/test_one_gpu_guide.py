"""The guide's one-GPU block, run as written with the test suite's verl (the docs' own runs have the demo's
environment, without verl): verl's entry point composes its config with the options and starts nothing."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[1] / "guides" / "rl-batch-interleaving" / "README.md"
BLOCK = re.compile(r"<!-- doc-run: skip verl: [^>]*test_one_gpu_guide\.py[^>]* -->\n```bash\n(.*?)```", re.S)


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="needs verl installed (pip install '.[verl]')")
def test_the_guides_one_gpu_block_prints_what_the_options_set_in_verls_config(tmp_path):
    (block,) = BLOCK.findall(GUIDE.read_text())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    got = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    lines = [line.strip() for line in got.stdout.splitlines()]
    assert {"backend: timeslice_ipc", "hybrid_engine: false", "num_gpus: 2", "timeslice:"} <= set(lines), lines
    assert not list(tmp_path.iterdir()), "it wrote nothing: --cfg job starts no run"
