"""Which versions are validated and when (pure)."""

from __future__ import annotations

import pytest

from timeslice_verl.validate.schedule import Late, Move, Schedule


@pytest.mark.parametrize("events, moves, late, done", [
    # every 2: versions 2, 4, 6 are pushed, each run ending before the next is due
    ([("sync", 1), ("sync", 2), ("end", 2), ("sync", 3), ("sync", 4), ("end", 4), ("sync", 6)],
     ["none", "push", None, "none", "push", None, "push"], [], [2, 4]),
    # version 4 due while 2 still runs: 4 held, 2 reported late; at 2's end the held 4 is the next to push
    ([("sync", 2), ("sync", 4), ("end", 2), ("end", 4)], ["push", "hold", 4, None], [Late(2, 4)], [2, 4]),
    # 4 held, then 6 due while 2 still runs: 4 is superseded (reported), 6 held instead
    ([("sync", 2), ("sync", 4), ("sync", 6), ("end", 2), ("end", 6)],
     ["push", "hold", "hold", 6, None], [Late(2, 4), Late(2, 6), Late(4, 6, superseded=True)], [2, 6]),
    # a version synced twice (a sync that did nothing new) is not validated twice
    ([("sync", 2), ("sync", 2), ("end", 2), ("sync", 2)], ["push", "none", None, "none"], [], [2]),
    # an end for a version that is not running changes nothing
    ([("sync", 2), ("end", 4)], ["push", None], [], []),
])
def test_the_schedule(events, moves, late, done):
    s, got = Schedule(every=2), []
    for what, version in events:
        if what == "sync":
            got.append(str(s.synced(version)))
        else:
            got.append(s.finished(version))
    assert got == moves and s.late == late and s.done == done


def test_validation_off_or_version_zero_is_never_due():
    assert not Schedule(every=0).due(4) and not Schedule(every=2).due(0)
    assert Schedule(every=0).synced(4) is Move.none


def test_a_late_report_says_which_version_and_why():
    assert str(Late(2, 4)) == "the validation of version 2 was still running when version 4 was due"
    assert "superseded" in str(Late(4, 6, superseded=True))
