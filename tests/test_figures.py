"""Every measured table in the README, docs/ and the guides is what its run's committed raw data gives, through the
reader of its experiment; every run kept in the tree is cited by a document and says what ran."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # the readers, whichever test imports them first


def _figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("figures", module)
    spec.loader.exec_module(module)
    return module


def test_every_generated_table_matches_the_committed_raw_data():
    figures = _figures()
    assert figures.stale() == []


def test_every_run_in_the_tree_is_cited_by_a_document_and_every_citation_is_a_run():
    """Runs no document cites live in git history, not in the tree; a cited path that is no run is a broken link."""
    figures = _figures()
    kept = {f"{p.parent.name}/{p.name}" for p in figures.runs()}
    assert figures.cited() == kept


def test_every_run_has_a_manifest_saying_what_ran_where_and_when():
    from readers.common import MANIFEST_KEYS

    for folder in _figures().runs():
        manifest = json.loads((folder / "manifest.json").read_text())
        assert all(manifest.get(k) for k in MANIFEST_KEYS if k != "commit"), folder
        assert manifest["experiment"] == folder.parent.name, folder
        assert folder.name.startswith(manifest["date"]), folder


def test_a_changed_figure_is_caught(tmp_path):
    figures = _figures()
    for doc, text in figures.documents().items():
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / doc).write_text(text.replace("| 8 | 0.13 / 1.38 |", "| 8 | 0.12 / 1.38 |"))
    assert figures.stale(tmp_path) == ["docs/measured.md: verl-run/2026-11-30-h200x2:rows",
                                       "guides/rl-batch-interleaving/README.md: verl-run/2026-11-30-h200x2:rows"]


def test_a_table_a_run_does_not_have_is_named():
    figures = _figures()
    try:
        figures.table("verl-run/2026-11-30-h200x2", "bounds")
    except KeyError as e:
        assert "verl-run/2026-11-30-h200x2 has no table 'bounds' (it has: rows)" in str(e)
    else:
        raise AssertionError("an unknown table was printed")


def test_the_validated_run_row_is_recomputed_from_the_timeline_itself():
    """The park row's trainer wait, straight from the JSONL (every acquire after start-up)."""
    from readers.common import open_run

    figures = _figures()
    run = open_run("verl-run/2026-11-30-h200x2")
    lines = (run.data / "interleave-park-8steps-timeline.jsonl").read_text()
    records = [json.loads(line) for line in lines.splitlines() if line.strip()]
    waits = [r["waited_s"] for r in records if r["hook"] == "handoff" and r["action"] == "acquire"
             and r["point"] != "init_workers_begin"]
    row = next(line for line in figures.table("verl-run/2026-11-30-h200x2", "rows").splitlines() if "8 steps" in line)
    assert f"| {statistics.median(waits):.2f} / {max(waits):.2f} |" in row
