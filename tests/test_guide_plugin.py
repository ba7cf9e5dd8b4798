"""The plugin guide's code, run as written: its ten-line plugin as a module, its tests through pytester (an inner
pytest with this package's pytest plugin, as a plugin author's suite runs), and its pyproject.toml built."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

GUIDE = Path(__file__).resolve().parent.parent / "guides" / "writing-hook-plugins.md"
pytest_plugins = ["pytester"]


def _block(starts: str, lang: str = "python") -> str:
    for m in re.finditer(rf"```{lang}\n(.*?)```", GUIDE.read_text(), re.S):
        if m.group(1).startswith(starts):
            return m.group(1)
    raise AssertionError(f"no {lang} block starting {starts!r} in {GUIDE.name}")


def _package(root: Path) -> None:
    (root / "mypkg").mkdir()
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "slack_alert.py").write_text(_block("# mypkg/slack_alert.py"))


def test_the_guides_tests_pass_against_its_plugin(pytester):
    _package(pytester.path)
    pytester.makepyfile(test_slack_alert=_block("# tests/test_slack_alert.py"))
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_the_guides_tests_fail_when_the_plugin_says_nothing(pytester):
    """They test the plugin's code: a plugin that prints nothing fails both."""
    _package(pytester.path)
    silent = (pytester.path / "mypkg" / "slack_alert.py").read_text().replace("print(", "str(")
    (pytester.path / "mypkg" / "slack_alert.py").write_text(silent)
    pytester.makepyfile(test_slack_alert=_block("# tests/test_slack_alert.py"))
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)


def test_the_guides_pyproject_builds(tmp_path):
    _package(tmp_path)
    (tmp_path / "mypkg" / "__init__.py").write_text("from mypkg.slack_alert import handoff, trainer_exception\n")
    toml = _block("# pyproject.toml", "toml").replace("timeslice_alert:AlertPlugin", "mypkg")
    (tmp_path / "pyproject.toml").write_text(toml + '\n[tool.hatch.build.targets.wheel]\npackages = ["mypkg"]\n')
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path / "dist"), str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert [p.name for p in (tmp_path / "dist").glob("timeslice_alert-0.1.0-*.whl")]
