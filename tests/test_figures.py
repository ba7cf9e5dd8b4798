"""Every measured table in docs/measured.md, the guides and docs/architecture.md is what its raw data gives."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("figures", module)
    spec.loader.exec_module(module)
    return module


def test_every_generated_table_matches_the_committed_raw_data():
    figures = _figures()
    assert figures.stale() == []


def test_the_documents_carry_the_generated_tables():
    figures = _figures()
    found = {m.group(2) for text in figures.documents().values() for m in figures.BLOCK.finditer(text)}
    assert found == set(figures.TABLES)


def test_a_changed_figure_is_caught(tmp_path):
    figures = _figures()
    for doc, text in figures.documents().items():
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / doc).write_text(text.replace("| 8 | 0.13 / 1.38 |", "| 8 | 0.12 / 1.38 |"))
    assert figures.stale(tmp_path) == ["docs/measured.md: verl-run", "guides/rl-batch-interleaving/README.md: verl-run"]


def test_the_validated_run_row_is_recomputed_from_the_timeline_itself():
    """The park row's trainer wait, straight from the JSONL (every acquire after start-up)."""
    import json
    import statistics

    lines = (ROOT / "benchmarks/results/2026-11-30-verl-h200x2/interleave-park-8steps-timeline.jsonl").read_text()
    records = [json.loads(line) for line in lines.splitlines() if line.strip()]
    waits = [r["waited_s"] for r in records if r["hook"] == "handoff" and r["action"] == "acquire"
             and r["point"] != "init_workers_begin"]
    row = next(line for line in _figures().verl_run().splitlines() if "8 steps" in line)
    assert f"| {statistics.median(waits):.2f} / {max(waits):.2f} |" in row
