"""The plugin guide's package, as written: its blocks are the files of hooks/timeslice-alert, which installs in
development mode into a fresh virtualenv and works there without PYTHONPATH (entry point found, its tests pass
under the test kit, strict: a hook that prints and then raises fails them), and builds as a wheel."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "guides" / "writing-hook-plugins.md"
PACKAGE = ROOT / "hooks" / "timeslice-alert"
FILES = ["pyproject.toml", "src/timeslice_alert/__init__.py", "tests/test_alert.py"]


def _blocks() -> dict[str, str]:
    """The guide's python and toml blocks, by the path their first line names (``# src/…``)."""
    found = {}
    for m in re.finditer(r"```(?:python|toml)\n(.*?)```", GUIDE.read_text(), re.S):
        first = m.group(1).splitlines()[0]
        if first.startswith("# ") and "/" in first or first.endswith(".toml"):
            found[first[2:].strip()] = m.group(1)
    return found


def test_the_guides_blocks_are_the_example_packages_files():
    blocks = _blocks()
    assert sorted(blocks) == sorted(FILES)
    for name in FILES:
        assert blocks[name] == (PACKAGE / name).read_text(), f"{name}: the guide and hooks/timeslice-alert differ"


def _environment(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A fresh virtualenv that sees this interpreter's packages (timeslice-verl, pytest, hatchling) as an
    installed timeslice-verl would be seen, and an environment without PYTHONPATH."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = [str(ROOT / "src"), *(p for p in sys.path if p and "site-packages" in p), sysconfig.get_paths()["purelib"]]
    Path(purelib, "timeslice_here.pth").write_text("\n".join(dict.fromkeys(ours)) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    return py, env


def _run(argv: list, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_an_editable_install_works_without_pythonpath(tmp_path):
    pkg = tmp_path / "timeslice-alert"
    shutil.copytree(PACKAGE, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    py, env = _environment(tmp_path)
    done = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                 "--prefix", tmp_path / "venv", "-e", pkg], env, tmp_path)
    assert done.returncode == 0, done.stderr
    listed = _run([py, "-m", "timeslice_verl", "plugins"], env, tmp_path)
    assert re.search(r"^alert\s+entry point timeslice-alert 0\.1\.0\s+handoff, timeslice_start, trainer_exception",
                     listed.stdout, re.M), listed.stdout + listed.stderr
    tests = _run([py, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider"], env, pkg)
    assert tests.returncode == 0 and "3 passed" in tests.stdout, tests.stdout + tests.stderr

    # the kit is strict: the plugin prints, then raises in its observing hook -> its tests fail, saying why
    module = pkg / "src" / "timeslice_alert" / "__init__.py"
    module.write_text(module.read_text().replace(
        "for its GPU at step {event.step}\")", "for its GPU at step {event.step}\")\n"
        "            raise RuntimeError(\"the webhook is down\")"))
    tests = _run([py, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider"], env, pkg)
    assert tests.returncode == 1 and "2 failed, 1 passed" in tests.stdout, tests.stdout + tests.stderr
    assert "plugin 'plugin-1' raised in handoff: RuntimeError('the webhook is down')" in tests.stdout


@pytest.mark.slow
def test_the_package_builds_as_a_wheel(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                          str(tmp_path / "dist"), str(PACKAGE)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert [p.name for p in (tmp_path / "dist").glob("timeslice_alert-0.1.0-py3-none-any.whl")]
