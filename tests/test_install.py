"""`pip install .` into a fresh virtualenv: the core imports and runs without verl or torch."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
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


@pytest.mark.slow
def test_the_wheel_builds_offline_and_its_command_runs(tmp_path):
    """The README's wheel path until the package is published: hatchling builds it with no index (no build
    isolation), pip installs it alone (--no-deps) into a folder, and its console script runs from there, importing
    the package and the Hydra group that ship inside the wheel, not the source tree."""
    dist, target = tmp_path / "dist", tmp_path / "target"
    offline = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    offline.pop("PYTHONPATH", None)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(dist), str(ROOT)], capture_output=True, text=True, env=offline, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("timeslice_verl-*-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert {"timeslice_verl/conf/timeslice/interleave.yaml", "timeslice_verl/testing/pytest_plugin.py",
            "timeslice_verl/batch/sql/queries.sql", "timeslice_verl/batch/sql/schema.sql",
            "timeslice_verl/batch/sql/setup.sql",
            "timeslice_verl/standin/__main__.py"} <= names
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, env=offline, timeout=600)
    assert done.returncode == 0, done.stderr
    env = {**offline, "PYTHONPATH": str(target)}
    helped = subprocess.run([str(target / "bin" / "timeslice-verl"), "--help"], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert "demo" in helped.stdout and "batch" in helped.stdout
    where = subprocess.run([sys.executable, "-c", "import timeslice_verl.config.overrides as c; print(c.conf_dir())"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert where.stdout.strip() == str(target / "timeslice_verl" / "conf"), where.stdout + where.stderr
