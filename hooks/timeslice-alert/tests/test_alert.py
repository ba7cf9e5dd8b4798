# tests/test_alert.py
from timeslice_verl.config.schema import PluginSettings, TimesliceSettings
from timeslice_verl.hooks.events import HandoffEvent
from timeslice_verl.testing import fake_event_sequence, play

from timeslice_alert import AlertPlugin


def test_a_long_wait_is_told_and_a_short_one_is_not(timeslice_lifecycle, capsys):
    lc = timeslice_lifecycle(AlertPlugin())          # real manager + dispatcher, your plugin, a recorder
    lc.handoff(lc.event(HandoffEvent, action="acquire", waited_s=45.0))
    lc.handoff(lc.event(HandoffEvent, action="acquire", waited_s=2.0))
    assert capsys.readouterr().out.count("waited") == 1


def test_the_threshold_is_a_setting(timeslice_lifecycle, capsys):
    settings = TimesliceSettings(plugins=PluginSettings(options={"alert": {"threshold_s": 1}}))
    lc = timeslice_lifecycle(AlertPlugin(), settings=settings)
    lc.handoff(lc.event(HandoffEvent, action="acquire", waited_s=2.0))
    assert "waited 2 s" in capsys.readouterr().out


def test_a_crash_is_told(timeslice_lifecycle, timeslice_recorder, capsys):
    lc = timeslice_lifecycle(AlertPlugin())
    play(lc, fake_event_sequence(3, crash_at=2))     # init, pre-fit sync, 2 steps, trainer_exception, stop
    assert "crashed at fit" in capsys.readouterr().out
    assert timeslice_recorder.events("timeslice_stop")[0].reason == "error"
