"""What every table of ``benchmarks/figures.py`` shares: where the results are, how a figure is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _f(value: Any, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pct(value: Any) -> str:
    return "–" if value is None else f"{value * 100:.0f} %"
