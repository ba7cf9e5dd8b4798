"""What every experiment's reader shares: where the runs are, how a run is opened, how a figure is written.

A run is one folder ``benchmarks/results/EXPERIMENT/DATE-MACHINE[-x]/``: ``manifest.json`` (what ran, on which machine,
when, at which commit, the command, the summary it produced), ``README.md`` where the run has notes, and
``raw.tar.gz``, the raw data as the benchmark wrote it. Readers work on the unpacked raw data; it is unpacked once into
a cache folder named by the archive's digest, so two readers (or two copies of the suite) never see half a folder.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MANIFEST_KEYS = ("experiment", "machine", "date", "commit", "command", "summary")
"""What every run's ``manifest.json`` says."""


@dataclass(frozen=True)
class Run:
    """One committed run: its folder in the tree, its manifest, and the folder its raw data reads from."""

    folder: Path
    manifest: dict[str, Any]
    data: Path

    @property
    def name(self) -> str:
        return f"{self.folder.parent.name}/{self.folder.name}"


def _unpacked(archive: Path) -> Path:
    """The folder ``archive`` unpacks to, unpacked the first time it is asked for (atomically, by a rename)."""
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / "timeslice-results"
    target = cache / digest
    if target.is_dir():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=f".{digest}-"))
    with tarfile.open(archive) as tar:
        tar.extractall(staging, filter="data")
    try:
        os.rename(staging, target)
    except OSError:  # another reader got there first: its copy is the same bytes
        if not target.is_dir():
            raise
    return target


def open_run(folder: Path | str) -> Run:
    """The run at ``folder`` (a path, or ``EXPERIMENT/RUN`` under ``benchmarks/results``), its raw data unpacked."""
    path = Path(folder)
    if not (path / "manifest.json").exists():
        path = RESULTS / folder
    manifest_path = path / "manifest.json"
    if not manifest_path.exists():
        raise FileNotFoundError(f"{folder}: no run here (a run is a folder with a manifest.json under {RESULTS})")
    manifest = json.loads(manifest_path.read_text())
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise ValueError(f"{manifest_path}: the manifest lacks {', '.join(missing)}")
    archive = path / "raw.tar.gz"
    return Run(path.resolve(), manifest, _unpacked(archive) if archive.exists() else path.resolve())


def runs() -> list[Path]:
    """Every committed run's folder, sorted."""
    return sorted(p.parent for p in RESULTS.glob("*/*/manifest.json"))


def _f(value: Any, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pct(value: Any) -> str:
    return "–" if value is None else f"{value * 100:.0f} %"


def jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path``, or of ``path.gz`` where the benchmark wrote them compressed (the 100 ms samples)."""
    gz = path.with_name(path.name + ".gz")
    text = gzip.decompress(gz.read_bytes()).decode() if gz.exists() and not path.exists() else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]
