"""The plugin test kit is strict by default: a hook that raises fails the test, though a trainer would only log
an observing hook's error. Run through pytester, as a plugin author's own suite runs (the kit loads through its
``pytest11`` entry point)."""

from __future__ import annotations

pytest_plugins = ["pytester"]

PLUGIN = '''
from timeslice_verl import hookimpl


class Alert:
    @hookimpl
    def handoff(self, event):
        print(f"waited {event.waited_s:.0f} s")
        if RAISES:
            raise RuntimeError("the alert's webhook is down")

    @hookimpl
    def pre_train_step(self, event):
        if RAISES:
            raise RuntimeError("refusing to train")
'''

TESTS = '''
import pytest
from timeslice_verl.hooks.events import HandoffEvent, TrainStepEvent
from alert import Alert


def test_a_long_wait_is_told(timeslice_lifecycle, capsys):
    lc = timeslice_lifecycle(Alert())
    lc.handoff(lc.event(HandoffEvent, action="acquire", waited_s=45.0))
    assert "waited 45 s" in capsys.readouterr().out


@pytest.mark.timeslice_hook_errors
def test_marked_as_expecting_errors(timeslice_lifecycle, capsys):
    lc = timeslice_lifecycle(Alert())
    lc.handoff(lc.event(HandoffEvent, action="acquire", waited_s=45.0))
    assert "waited 45 s" in capsys.readouterr().out


def test_one_lenient_lifecycle_sees_its_errors(timeslice_lifecycle):
    lc = timeslice_lifecycle(Alert(), strict=False)
    lc.handoff(lc.event(HandoffEvent, action="acquire", waited_s=45.0))
    assert [e.hook for e in lc.manager.hook_errors] == (["handoff"] if RAISES else [])


def test_a_gating_error_caught_by_the_test(timeslice_lifecycle):
    lc = timeslice_lifecycle(Alert())
    if RAISES:
        with pytest.raises(RuntimeError, match="refusing"):
            lc.pre_train_step(lc.event(TrainStepEvent))
    else:
        lc.pre_train_step(lc.event(TrainStepEvent))
'''


def _suite(pytester, raises: bool):
    pytester.makepyfile(alert=f"RAISES = {raises}\n" + PLUGIN)
    pytester.makepyfile(test_alert=f"RAISES = {raises}\n" + TESTS)
    return pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider", "-rf")


def test_a_hook_that_prints_then_raises_fails_its_test(pytester):
    result = _suite(pytester, raises=True)
    # strict: the raising handoff and the caught gating error fail; the marker and strict=False opt out
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines([
        "*FAILED*test_a_long_wait_is_told*",
        "*FAILED*test_a_gating_error_caught_by_the_test*",
    ])
    result.stdout.fnmatch_lines(["*plugin 'plugin-1' raised in handoff: RuntimeError(\"the alert's webhook is down\")*"])
    result.stdout.fnmatch_lines(["*timeslice_hook_errors*"])


def test_a_plugin_that_does_not_raise_passes(pytester):
    result = _suite(pytester, raises=False)
    result.assert_outcomes(passed=4)
