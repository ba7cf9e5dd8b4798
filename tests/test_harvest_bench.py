"""benchmarks/harvest.py's own parts: each valley's tokens from vLLM's counter, the figures over a
bracketed capacity, the capacity client by lines or for a time."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _harvest() -> ModuleType:
    """benchmarks/harvest.py as a module (it imports its siblings from its own folder)."""
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("harvest_bench", bench / "harvest.py")
        assert spec is not None and spec.loader is not None
        harvest = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(harvest)
    finally:
        sys.path.remove(str(bench))
    return harvest


def test_the_harvest_benchmark_counts_each_valleys_tokens_from_vllms_counter(tmp_path):
    """benchmarks/harvest.py: a valley is a release to the next acquire; its tokens, vLLM's counter at its two ends
    (linear between the reads around each) in the run's own phase (reads of other phases do not count); the harvest's
    figures are over those tokens, per second vLLM had the GPU and per idle second."""
    harvest = _harvest()
    run = tmp_path / "run.jsonl"
    run.write_text("".join(json.dumps({"hook": "handoff", "time": t, "action": a, "ok": True}) + "\n" for t, a in
                           [(0.0, "acquire"), (1.0, "release"), (5.0, "acquire"), (6.0, "release"), (8.0, "acquire")]))
    reads = [(0.5, "p", 0), (1.1, "p", 100), (3.0, "p", 900), (4.9, "p", 2100), (3.5, "other", 10**6),
             (5.5, "p", 2100), (6.2, "p", 2200), (7.9, "p", 2600), (8.1, "p", 2700)]
    inflight = tmp_path / "inflight.jsonl"
    inflight.write_text("".join(json.dumps({"t": t, "phase": ph, "running": 1, "waiting": 0, "generated": g}) + "\n"
                                for t, ph, g in reads))
    got = harvest.valley_tokens(run, inflight, "p")
    # 1.0 → 5.0: 83.3 (between 0 at 0.5 and 100 at 1.1) to 2100; 6.0 → 8.0: 2171.4 to 2650
    assert [(v["seconds"], v["tokens"]) for v in got] == [(4.0, 2017), (2.0, 479)]
    assert harvest.phase_generated(inflight, "p") == 2700 and harvest.phase_generated(inflight, "none") == 0
    figures = harvest.valley_figures({"valleys": got, "capacity_tokens_per_s": 100.0, "vllm_s": 5.0, "trainer_idle_s": 6.0})
    assert figures == {"valley_tokens": 2496, "serving_vs_capacity": 4.992, "idle_vs_capacity": 4.16}
    # --bracket: (a) again after (c); the row over the best of both passes, and over the higher of that and (b)
    row = {"valleys": got, "capacity_tokens_per_s": 100.0, "vllm_s": 5.0, "trainer_idle_s": 6.0, "mix_tokens": 48,
           "profile": "fleet"}
    again = harvest.bracketed(tmp_path, row, 100.0, 160.0, 200.0)
    assert (again["capacity_tokens_per_s"], again["serving_vs_capacity"], again["idle_vs_capacity"]) == (160.0, 3.12, 2.6)
    assert (again["serving_vs_highest"], again["idle_vs_highest"]) == (2.496, 2.08)
    assert json.loads((tmp_path / "row-48-fleet.json").read_text()) == again
    assert harvest.steady_best([{"tokens_per_s": 90.0, "steady_tokens_per_s": 120.0}, {"tokens_per_s": 130.0}]) == 130.0


def test_the_capacity_client_keeps_its_requests_out_by_lines_or_for_a_time(procs):
    """harvest.py's (a): by lines, every body once; by time (``--capacity-s``), the bodies sent again and again until
    the time is up. Either way its counts are its answers' (no figure of the stand-in's speed is asserted)."""
    import asyncio

    from agent_support import FakeVllmProc

    harvest = _harvest()
    tenant = FakeVllmProc("--token-s", "0.001")
    procs.append(tenant)
    bodies = [json.dumps({"model": "m", "prompt": f"p{i}", "max_tokens": 8}).encode() for i in range(6)]
    reads, counter = [], harvest._generated

    async def counted(session):  # vLLM's counter read once at each end of the steady window, never more
        reads.append(1)
        return await counter(session)

    harvest._generated = counted
    by_lines = asyncio.run(harvest._capacity(tenant.url, bodies, 4))
    assert (by_lines["lines"], by_lines["tokens"]) == (6, 48) and by_lines["inflight"] == 4
    assert len(reads) == 2
    by_time = asyncio.run(harvest._capacity(tenant.url, bodies, 4, seconds=0.5))
    assert by_time["tokens"] == 8 * by_time["lines"]
    assert len(reads) == 4  # four workers saw the time up: one read for the mark
    assert tenant.stats()["completed"] == 6 + by_time["lines"]


def test_each_row_over_the_passes_around_it(tmp_path):
    """--bracket-rows: a capacity pass before the first row and one after each; each row over the best of the two
    around it, and over the best of all (``*_vs_all_passes``); --bracket (one pass before all, one after all) gives
    every row the same two; any other count is refused, naming both counts."""
    harvest = _harvest()
    valleys = [{"start": 0.0, "seconds": 1.0, "tokens": 90, "tokens_per_s": 90.0}]
    rows = [{"valleys": valleys, "capacity_tokens_per_s": 100.0, "vllm_s": 1.0, "trainer_idle_s": 1.0, "mix_tokens": 48,
             "profile": p} for p in ("fleet", "longtail")]
    got = harvest.bracket_rows(tmp_path, rows, [100.0, 60.0, 150.0], None)
    assert [(r["capacity_before"], r["capacity_after"], r["serving_vs_capacity"]) for r in got] == \
        [(100.0, 60.0, 0.9), (60.0, 150.0, 0.6)]
    assert [(r["serving_vs_all_passes"], r["idle_vs_all_passes"]) for r in got] == [(0.6, 0.6), (0.6, 0.6)]
    assert json.loads((tmp_path / "row-48-longtail.json").read_text()) == got[1]
    ends = harvest.bracket_rows(tmp_path, rows, [100.0, 120.0], None)
    assert [(r["capacity_before"], r["capacity_after"], r["serving_vs_capacity"]) for r in ends] == \
        [(100.0, 120.0, 0.75), (100.0, 120.0, 0.75)]
    with pytest.raises(ValueError, match="4 capacity passes for 2 rows"):
        harvest.bracket_rows(tmp_path, rows, [1.0, 2.0, 3.0, 4.0], None)


def test_the_stand_ins_step_length_reads_through_the_samplers_parser(procs):
    """The stand-in reports vLLM's inter-token latency totals: one per token generated, their sum the time its tokens
    took; ``hostload.itl_totals`` reads them as the sampler does (a count and a positive sum, no speed asserted)."""
    import httpx

    from agent_support import FakeVllmProc

    _harvest()  # harvest.py imports hostload from its folder: importable by name from here on
    import hostload

    tenant = FakeVllmProc("--token-s", "0.001")
    procs.append(tenant)
    before = hostload.itl_totals(httpx.get(f"{tenant.url}/metrics", timeout=10).text)
    assert before == {"itl_sum": 0.0, "itl_count": 0.0}
    body = {"model": "m", "prompt": "p", "max_tokens": 16}
    assert httpx.post(f"{tenant.url}/v1/completions", json=body, timeout=60).json()["usage"]["completion_tokens"] == 16
    after = hostload.itl_totals(httpx.get(f"{tenant.url}/metrics", timeout=10).text)
    assert after["itl_count"] == 16.0 == tenant.stats()["generated"]
    assert after["itl_sum"] > 0.0
