"""How a plugin author tests a hook plugin: the fixtures timeslice-verl ships, no verl, no GPU."""

import csv

from timeslice_verl.config.schema import PluginSettings, TimesliceSettings
from timeslice_verl.hooks.events import HandoffEvent, Transition
from timeslice_verl.testing import fake_event_sequence, play

from timeslice_csv import COLUMNS, CsvHandoffPlugin


def settings(tmp_path):
    return TimesliceSettings(job="csv-test", plugins=PluginSettings(options={"csv": {"path": str(tmp_path / "h.csv")}}))


def test_one_row_per_handoff(tmp_path, timeslice_lifecycle, timeslice_recorder):
    plugin = CsvHandoffPlugin()
    lc = timeslice_lifecycle(plugin, settings=settings(tmp_path))
    lc.start()
    thaw = Transition("thaw", "csv-test", start=10.0, end=10.25, bytes=2 * 2**30)
    freeze = Transition("freeze", "csv-test", start=9.0, end=9.5, bytes=2 * 2**30)
    lc.handoff(lc.event(HandoffEvent, action="acquire", point="pre_train_step", waited_s=0.3, transitions=(freeze, thaw)))
    lc.handoff(lc.event(HandoffEvent, action="release", point="weight_sync_end", waited_s=0.002))
    lc.stop()
    rows = list(csv.DictReader(open(tmp_path / "h.csv")))
    assert [r["action"] for r in rows] == ["acquire", "release"]
    assert rows[0]["thaw_ms"] == "250.0" and rows[0]["freeze_ms"] == "500.0" and rows[0]["frozen_gib"] == "2.000"
    assert list(rows[0]) == COLUMNS
    assert timeslice_recorder.names.count("handoff") == 2


def test_a_whole_fake_run_writes_no_rows_without_handoffs(tmp_path, timeslice_lifecycle):
    lc = timeslice_lifecycle(CsvHandoffPlugin(), settings=settings(tmp_path))
    play(lc, fake_event_sequence(3, save_at=(2,)))
    assert (tmp_path / "h.csv").read_text().splitlines() == [",".join(COLUMNS)]
