"""The product speaks of itself, not of how it was made: no working period, run or issue number in its code, tests,
configuration, hooks, guides, benchmarks, docs, CI or README, and no file named after one — a reader picking the
project up should not have to tell the product from its history (git keeps the history)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("src", "tests", "conf", "hooks", "guides", "deploy", "benchmarks", "docs", ".ci")
RAW_DATA = ROOT / "benchmarks" / "results"
"""The raw data: its files and folder names are the measurements' own, kept as they were written."""
TOP = ("README.md",)
PROCESS_WORD = re.compile(r"(?<![a-z0-9])(?:sessions?|rounds?|runs?|issues?)[ _-]?#?\d", re.IGNORECASE)
"""A process word followed by a number ("run 16", "issue 36", "round5"): a database, HTTP or process session, a round
trip, Python's ``round()`` and a run of the trainer are the product's own words and carry no number."""
NAMED_FOR_PROCESS = re.compile(r"session|(?<![a-z])round(?!_?trip)", re.IGNORECASE)
DATA_PATH = re.compile(r"benchmarks/results/\S*")
"""A raw data folder's path names the data it cites; the folders' own names are the benchmarks' to keep."""
LINK_ANCHOR = re.compile(r"(?<=\]\()[^)\s]*#[^)\s]+(?=\))")
"""A Markdown link's target with an anchor: the anchor is its heading's, made by the renderer from the heading's words
(``Validated run (2026-11-30, …)`` → ``#validated-run-2026-11-30-…``), and the heading is checked where it stands."""
PENDING: set[str] = set()
"""Files whose process words go with a change of their own: each leaves this set as it is cleaned, which the check
below insists on (empty: every file is clean)."""


def _text_files() -> list[Path]:
    files = [ROOT / name for name in TOP]
    for top in PRODUCT:
        files += [p for p in (ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and not any(part.endswith(".egg-info") for part in p.parts) and not p.is_relative_to(RAW_DATA)]
    return files


def process_words(text: str) -> list[str]:
    """Every process word with a number in ``text``, raw data paths and links' anchors left out."""
    return [m.group(0) for line in text.splitlines()
            for m in PROCESS_WORD.finditer(LINK_ANCHOR.sub("", DATA_PATH.sub("", line)))]


def test_no_process_word_with_a_number_in_the_product():
    found = {}
    for path in _text_files():
        where = path.relative_to(ROOT).as_posix()
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # an image or other binary file
        if path != Path(__file__) and (words := process_words(text)):  # this file's examples are the check's own
            found[where] = words
    assert not found.keys() - PENDING, {k: v for k, v in found.items() if k not in PENDING}
    assert not PENDING - found.keys(), f"clean now: drop {sorted(PENDING - found.keys())} from PENDING"


def test_no_file_of_the_product_is_named_after_a_working_period():
    named = [p.relative_to(ROOT).as_posix() for p in _text_files() if NAMED_FOR_PROCESS.search(p.name)]
    assert not named, named


def test_the_checks_read_benchmarks_docs_and_ci_but_not_the_raw_data():
    files = {p.relative_to(ROOT).as_posix() for p in _text_files()}
    assert {"benchmarks/harvest.py", "docs/measured.md", ".ci/run"} <= files
    assert not [f for f in files if f.startswith("benchmarks/results/")]


def test_the_word_check_tells_a_process_from_the_products_own_words():
    flagged = ("seen in run 16 of the harvest", "issue 36, item 4", "Round 5 (2026-12-01)", "test_round3.py",
               "runs 27 and 28", "sessions 3-5",
               "[run 16](../guides/x/README.md#validated-run-2026-11-30)", "`--out run37`")
    kept = ("a round trip of 1.2 s", "round(seconds, 3)", "one aiohttp session, connections kept alive",
            "started in a session of its own", "`benchmarks/results/2026-12-02-h200-harvest-session8/`",
            "in the same run, 512-token rows", "the watchdog's next probe",
            "the guide's [validated run](../guides/x/README.md#validated-run-2026-11-30-2--nvidia-h200)")
    assert [t for t in flagged if not process_words(t)] == []
    assert [t for t in kept if process_words(t)] == []
    assert NAMED_FOR_PROCESS.search("test_round4.py") and not NAMED_FOR_PROCESS.search("test_round_trip.py")
