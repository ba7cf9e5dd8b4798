"""What the readers take from a test log as pytest wrote it: each summary line's counts and time, the tests that
failed, and a repeated command's passes (the fresh-clone and side-by-side runs keep nothing else)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks import their siblings

from readers import common, fresh_clone  # noqa: E402


@pytest.mark.parametrize(("line", "want"), [
    ("======= 2 failed, 742 passed, 5 skipped, 1 warning in 837.22s (0:13:57) ========",
     {"passed": 742, "failed": 2, "skipped": 5, "error": 0, "warning": 1, "seconds": 837.22}),
    ("======================= 124 passed in 332.45s (0:05:32) ========================",
     {"passed": 124, "failed": 0, "skipped": 0, "error": 0, "seconds": 332.45}),
    ("==== 1 failed, 3 errors, 2 warnings in 1.50s ====",
     {"passed": 0, "failed": 1, "skipped": 0, "error": 3, "warning": 2, "seconds": 1.5}),
])
def test_each_pytest_summary_line_gives_its_counts_and_seconds(line, want):
    assert common.pytest_summaries(f"tests/test_a.py ....   [100%]\n{line}\nreal\t1m2.0s\n") == [want]


def test_a_log_of_two_pytest_commands_gives_both_and_a_line_that_only_mentions_passed_gives_none():
    text = ("E   assert '4 passed in 2.00s' == x\n=== 5 passed in 2.00s ===\nrc=0\n"
            "=== 1 failed, 1 passed in 3.00s ===\nFAILED tests/test_b.py::test_one - AssertionError\n")
    assert [s["passed"] for s in common.pytest_summaries(text)] == [5, 1]
    assert common.pytest_failures(text) == ["tests/test_b.py::test_one"]


@pytest.mark.parametrize(("seconds", "want"), [(837.22, "13 min 57 s"), (850.92, "14 min 11 s"), (24.2, "24 s"),
                                               (60.0, "1 min 0 s")])
def test_a_duration_reads_in_minutes_and_seconds(seconds, want):
    assert common.took(seconds) == want


def test_a_repeated_command_counts_a_failed_pass_against_all_passes():
    text = "pass 1: 4 passed in 29.75s\npass 2: 1 failed, 3 passed in 31.00s\npass 3: 4 passed in 24.17s\nall done\n"
    assert fresh_clone._repeats(text) == [["2 of 3", "4", "24.2–29.8"]]
