"""The harvest matrix: its covering design of valley shapes, the resume from the rows a run wrote, its summary and
reader (benchmarks/harvest_design.py, benchmarks/harvest_matrix.py, benchmarks/readers/harvest_matrix.py)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from itertools import groupby
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks import their siblings

import harvest_design as hd  # noqa: E402
import harvest_matrix  # noqa: E402
from readers import harvest_matrix as reader  # noqa: E402
from readers.common import open_run, write_run  # noqa: E402


def _pairs(rows, a, b):
    return {(getattr(r, a), getattr(r, b)) for r in rows}


def test_the_design_covers_every_pair_of_valley_mix_and_length_in_24_rows():
    rows = hd.design()
    assert len(rows) >= 24
    for a, b, levels_a, levels_b in (("valley_s", "mix", hd.VALLEYS_S, tuple(hd.Mix)),
                                     ("valley_s", "length", hd.VALLEYS_S, hd.LENGTHS),
                                     ("mix", "length", tuple(hd.Mix), hd.LENGTHS),
                                     ("valley_s", "train_s", hd.VALLEYS_S, hd.TRAINS_S)):
        assert _pairs(rows, a, b) == {(x, y) for x in levels_a for y in levels_b}, (a, b)
    assert len(rows) < len(hd.VALLEYS_S) * len(hd.TRAINS_S) * len(hd.Mix) * len(hd.LENGTHS)  # not the product
    assert all(r.steps >= 8 for r in rows)


def test_the_designs_seeds_spread_evenly_and_its_rows_run_together_by_length():
    rows = hd.design()
    spread = hd.seed_spread(rows)
    assert len(spread) >= 3 and max(spread.values()) - min(spread.values()) <= 1
    for _, group in groupby(rows, key=lambda r: r.length):  # one block per length: one batch input each
        seeds = Counter(r.seed for r in group)
        assert len(seeds) == 3
    assert [length for length, _ in groupby(r.length for r in rows)] == list(hd.LENGTHS)
    assert len({r.name for r in rows}) == len(rows)  # a row file per row


@pytest.mark.parametrize(("kwargs", "gap"), [
    pytest.param({"repeats": 1}, "train_s", id="one row a cell leaves a valley without a train phase"),
    pytest.param({"lengths": (48,)}, "mix", id="one length leaves a valley without a mix"),
])
def test_a_design_that_leaves_a_pair_uncovered_is_refused_naming_it(kwargs, gap):
    with pytest.raises(ValueError, match=gap):
        hd.design(**kwargs)


@pytest.mark.parametrize(("n", "lengths"), [(3, [48, 512, 2048]), (0, None), (99, None)])
def test_a_reduced_design_spreads_its_rows_over_the_lengths(n, lengths):
    rows = hd.reduced(hd.design(), n)
    assert [r.length for r in rows] == (lengths or [r.length for r in hd.design()])


def test_the_estimate_counts_solo_and_time_sliced_and_the_capacity_passes():
    row = hd.MatrixRow(length=48, valley_s=4.0, train_s=1.0, mix=hd.Mix.fleet, seed=0, steps=8)
    assert hd.row_estimate_s(row) == 2 * (8 * 5.0 + hd.RUN_START_S)
    pass_s = hd.capacity_estimate_s([32, 512], 10.0)
    assert hd.total_estimate_s([row, row], [32, 512], 10.0) == 2 * hd.row_estimate_s(row) + 2 * pass_s



@pytest.mark.parametrize(("call_s", "want"), [
    (1000.0, 1),  # the pass before (16 s), the rows (100 and 108 s) and the pass after (16 s) in one call
    (200.0, 2),   # the pass and the first row; the second row and the pass after
    (120.0, 3),   # the pass and the first row; the second row; the pass after, which 12 s left do not fit
])
def test_the_calls_estimate_packs_rows_and_passes_as_the_command_does(call_s, want):
    rows = hd.design()[:2]
    assert hd.capacity_estimate_s([32], 0.0) == 16.0
    assert hd.calls(rows, [32], 0.0, call_s) == want


def test_a_row_longer_than_a_call_is_refused():
    with pytest.raises(ValueError, match="longer than a call"):
        hd.calls(hd.design()[:2], [32], 0.0, 100.0)


def test_the_rows_a_run_wrote_are_skipped_and_a_row_cut_off_runs_again(tmp_path):
    rows = hd.design()[:3]
    hd.row_path(tmp_path, rows[0]).write_text("{}")
    hd.row_path(tmp_path, rows[1]).with_suffix(".tmp").write_text("{")  # a call's end cut it while writing
    assert hd.pending(tmp_path, rows) == rows[1:]


@pytest.mark.parametrize(("budget", "want"), [(0.0, 3), (1e9, 3), (100.0 + 108.0, 2), (99.0, 0)])
def test_a_call_starts_only_the_rows_its_budget_fits(budget, want):
    rows = hd.design()[:3]  # 100, 108 and 140 s
    assert [hd.row_estimate_s(r) for r in rows] == [100.0, 108.0, 140.0]
    assert hd.fits(rows, budget) == rows[:want]


def _args(out: Path, **kw) -> argparse.Namespace:
    return argparse.Namespace(out=out, levels="32", capacity_s=0.0, lines=10, **kw)


def test_the_command_resumes_a_length_where_the_last_call_left_it(tmp_path, monkeypatch):
    rows = [r for r in hd.design() if r.length == 512][:3]
    hd.capacity_path(tmp_path, 512, "before").write_text(json.dumps([{"tokens_per_s": 90, "steady_tokens_per_s": 100}]))
    hd.row_path(tmp_path, rows[0]).write_text("{}")
    ran, passes = [], []
    monkeypatch.setattr(harvest_matrix, "served_model", lambda url: "m")
    monkeypatch.setattr(harvest_matrix, "write_input", lambda path, *a: path.write_text("") or path)

    def capacity_pass(args, url, path, length, when, sampler):
        passes.append(when)
        hd.capacity_path(args.out, length, when).write_text("[]")
        return 1.0

    monkeypatch.setattr(harvest_matrix, "capacity_pass", capacity_pass)

    def run_row(args, url, row, best, sampler):
        ran.append((row, best))
        hd.row_path(args.out, row).write_text("{}")
        return {"serving_vs_capacity": 1, "idle_vs_capacity": 1, "step_ratio": 1}

    monkeypatch.setattr(harvest_matrix, "run_row", run_row)
    assert harvest_matrix.run_length(_args(tmp_path), "u", rows, None, float("inf"))
    assert ran == [(rows[1], 100), (rows[2], 100)] and passes == ["after"]
    assert not (tmp_path / "input-512.jsonl").exists()
    ran.clear(), passes.clear()
    assert harvest_matrix.run_length(_args(tmp_path), "u", rows, None, float("inf"))  # done: nothing again
    assert ran == [] and passes == []


def test_the_command_leaves_a_row_its_budget_cannot_fit_for_the_next_call(tmp_path, monkeypatch):
    rows = [r for r in hd.design() if r.length == 48][:2]
    monkeypatch.setattr(harvest_matrix, "served_model", lambda url: "m")
    monkeypatch.setattr(harvest_matrix, "write_input", lambda path, *a: path.write_text("") or path)
    passes = []
    monkeypatch.setattr(harvest_matrix, "capacity_pass", lambda args, url, path, length, when, s: passes.append(when) or 1.0)
    monkeypatch.setattr(harvest_matrix, "run_row", lambda *a: pytest.fail("a row started past the budget"))
    deadline = harvest_matrix.time.monotonic() + 50.0  # the first row takes about 100 s
    assert not harvest_matrix.run_length(_args(tmp_path), "u", rows, None, deadline)
    assert passes == ["before"]


def _row_file(out: Path, row: hd.MatrixRow, tokens: int, capacity: float) -> None:
    hd.row_path(out, row).write_text(json.dumps({
        "valleys": [{"tokens": tokens // 2}, {"tokens": tokens - tokens // 2}], "vllm_s": 10.0, "trainer_idle_s": 20.0,
        "capacity_tokens_per_s": capacity, "step_ratio": 1.002, "wait_s_median": 0.004, "wait_s_max": 0.05,
        "cut_tries": 7, "feeder": {"resumed": 5, "kept": 1200}, "lost": 0, "twice": 0}))


def _matrix(out: Path) -> list[hd.MatrixRow]:
    rows = hd.reduced(hd.design(), 3)
    out.mkdir()
    (out / "design.json").write_text(json.dumps([r.factors() for r in rows]))
    level = lambda best: json.dumps([{"tokens_per_s": best - 50, "steady_tokens_per_s": best},  # noqa: E731
                                     {"tokens_per_s": best - 10, "steady_tokens_per_s": None}])
    hd.capacity_path(out, 48, "before").write_text(level(200))
    hd.capacity_path(out, 48, "after").write_text(level(250))
    hd.capacity_path(out, 512, "before").write_text(level(400))
    _row_file(out, rows[0], 1000, 200.0)
    _row_file(out, rows[1], 1000, 400.0)
    return rows


def test_the_summary_reads_each_row_over_its_lengths_bracket_and_lists_rows_not_run(tmp_path):
    rows = _matrix(tmp_path / "out")
    got = hd.summary(tmp_path / "out", rows)
    first, second, third = got["rows"]
    assert (got["done"], got["total"]) == (2, 3)
    assert first["capacity_tokens_per_s"] == 250 and first["bracketed"]  # the better of before (200) and after
    assert (first["serving_vs_capacity"], first["idle_vs_capacity"]) == (0.4, 0.2)  # 100 and 50 tokens/s
    assert (first["cut"], first["resumed"], first["kept"]) == (7, 5, 1200)
    assert second["capacity_tokens_per_s"] == 400 and not second["bracketed"]  # no pass after yet
    assert second["serving_vs_capacity"] == 0.25
    assert not third["done"] and third["length"] == 2048
    assert got["capacity"] == {"48": {"before": 200, "after": 250}, "512": {"before": 400, "after": None},
                               "2048": {"before": None, "after": None}}


def test_the_reader_prints_the_summary_table_from_a_recorded_matrix(tmp_path):
    rows = _matrix(tmp_path / "matrix-out")
    folder = write_run(tmp_path / "2026-12-05-cpu", "harvest-matrix", "CPU", "python benchmarks/harvest_matrix.py",
                       "2 of 3 rows", [tmp_path / "matrix-out"])
    run = open_run(folder)
    tables = reader.tables(run)
    text = tables["rows"](run)
    assert text.splitlines()[0] == "2 of 3 rows done"
    assert "| 48 | 2 | 0.5 | fleet | 0 | 0.400 | 0.200 | 1.0020 | 0.004 / 0.050 | 7 / 5 (1200) | 0 / 0 |" in text
    assert "(no pass after yet)" in text and f"| 2048 | {rows[2].valley_s:g} |" in text and "not run" in text
    assert "| 48 | 200 | 250 | 1.250 |" in tables["capacity"](run)


def test_a_design_row_missing_a_factor_is_refused_naming_it():
    with pytest.raises(ValueError, match="seed"):
        hd.rows_from([{"length": 48, "valley_s": 2, "train_s": 1, "mix": "fleet", "steps": 8}])
