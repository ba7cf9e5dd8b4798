"""What every table of ``benchmarks/figures.py`` shares: where the results are, how a figure is written."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _f(value: Any, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pct(value: Any) -> str:
    return "–" if value is None else f"{value * 100:.0f} %"


def jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path``, or of ``path.gz`` where the raw data was committed compressed (the 100 ms samples
    from 2026-12-03's fourteenth session on: what travels to the GPU machine with the tree has a size limit)."""
    gz = path.with_name(path.name + ".gz")
    text = gzip.decompress(gz.read_bytes()).decode() if gz.exists() and not path.exists() else path.read_text()
    return [json.loads(line) for line in text.splitlines()]
