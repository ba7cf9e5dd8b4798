"""`pip install .` into a fresh virtualenv: the core imports and runs without verl or torch."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_core_installs_and_imports_without_verl_or_torch(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", str(ROOT)], check=True, timeout=900)
    probe = (
        "import importlib.util as u, sys, timeslice_verl, timeslice_verl.config.overrides as c;"
        "assert u.find_spec('verl') is None and u.find_spec('torch') is None, 'heavy deps leaked into the core';"
        "import timeslice_verl.hooks.manager, timeslice_verl.hooks.lifecycle, timeslice_verl.hooks.spec;"
        "assert 'site-packages' in str(c.conf_dir()), c.conf_dir();"
        "print(timeslice_verl.__version__, c.options())"
    )
    out = subprocess.run([py, "-c", probe], check=True, capture_output=True, text=True, timeout=120)
    assert "interleave" in out.stdout
    cli = env_dir / "bin" / "timeslice-verl"
    out = subprocess.run([cli, "config", "timeslice.job=fresh"], check=True, capture_output=True, text=True)
    assert "timeslice.job='fresh'" in out.stdout.splitlines()
    bad = subprocess.run([cli, "config", "timeslice.jobb=fresh"], capture_output=True, text=True)
    assert bad.returncode != 0 and "timeslice.jobb" in bad.stderr
