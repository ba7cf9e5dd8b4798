"""What every experiment's reader shares: where the runs are, how a run is opened, how a figure is written.

A run is one folder ``benchmarks/results/EXPERIMENT/DATE-MACHINE[-x]/``: ``manifest.json`` (what ran, on which machine,
when, at which commit, the command, the summary it produced), ``README.md`` where the run has notes, and
``raw.tar.gz``, the raw data as the benchmark wrote it. Readers work on the unpacked raw data; it is unpacked once into
a cache folder named by the archive's digest, so two readers (or two copies of the suite) never see half a folder.

The benchmarks write their run's folder themselves (``--record DIR``, through :func:`record`; a shell script through
``python3 benchmarks/readers/common.py record ...``): the manifest says what ran, so nobody writes it by hand, and the
archive is packed reproducibly (sorted names, fixed times and owners), so packing the same data twice gives the same
bytes and a re-recorded run shows in git only where its data changed.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import gzip
import hashlib
import io
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MANIFEST_KEYS = ("experiment", "machine", "date", "commit", "command", "summary")
"""What every run's ``manifest.json`` says."""
RUN_NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-[\w.-]+$")
"""A run's folder: ``DATE-MACHINE[-x]``, e.g. ``2026-12-04-h100`` or ``2026-12-01-h200-b``."""
log = logging.getLogger("timeslice.benchmarks")


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


PYTEST_SUMMARY = re.compile(r"^=+ (?P<counts>\d+ \w+(?:, \d+ \w+)*) in (?P<seconds>[\d.]+)s\b.* =+$")
"""pytest's last line: ``==== 2 failed, 742 passed, 5 skipped, 1 warning in 837.22s (0:13:57) ====``."""


def pytest_summaries(text: str) -> list[dict[str, float]]:
    """Each pytest summary line of a log, in order: its counts by outcome (``passed``, ``failed``, ``skipped``, …,
    absent ones 0) and ``seconds``; a log of several pytest commands has one each."""
    out = []
    for line in text.splitlines():
        if match := PYTEST_SUMMARY.match(line.strip()):
            counts = {w.rstrip("s") if w in ("warnings", "errors") else w: int(n)
                      for n, w in (c.split(" ", 1) for c in match.group("counts").split(", "))}
            out.append({"passed": 0, "failed": 0, "skipped": 0, "error": 0} | counts
                       | {"seconds": float(match.group("seconds"))})
    return out


def pytest_failures(text: str) -> list[str]:
    """The tests a pytest log's short summary names as failed (``FAILED path::test``), in order."""
    return [line.split()[1] for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]


def took(seconds: float) -> str:
    """``13 min 57 s``: a duration of minutes as the notes give it."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def commit() -> str:
    """The checkout's short commit, or ``unknown`` outside a checkout (a copy of the tree on a device machine)."""
    try:
        got = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return got.stdout.strip() if got.returncode == 0 and got.stdout.strip() else "unknown"


def machine() -> str:
    """The GPUs ``nvidia-smi`` lists with their driver (``1 x NVIDIA H200, driver 580.159.04``), else the CPU's cores."""
    try:
        got = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=False)
        gpus = [line.split(", ") for line in got.stdout.splitlines() if got.returncode == 0 and ", " in line]
    except (OSError, subprocess.TimeoutExpired):
        gpus = []
    if not gpus:
        return f"CPU, {os.cpu_count()} cores"
    return f"{len(gpus)} x {' + '.join(sorted({g[0] for g in gpus}))}, driver {gpus[0][1]}"


def command_line(argv: Sequence[str] | None = None) -> str:
    """How this program was started, its path relative to the repository: what the manifest's ``command`` says."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    shown = script.relative_to(ROOT).as_posix() if script.is_relative_to(ROOT) else argv[0]
    return shlex.join(["python", shown, *argv[1:]])


def _members(path: Path, name: str, exclude: Sequence[str]) -> Iterator[tuple[str, Path]]:
    """``(name in the archive, path)`` for ``path`` and, for a folder, everything under it, by name."""
    if any(fnmatch.fnmatch(path.name, pattern) for pattern in exclude):
        return
    if path.is_dir():
        yield name, path
        for child in sorted(path.iterdir(), key=lambda p: p.name):
            yield from _members(child, f"{name}/{child.name}", exclude)
    elif path.is_file():
        yield name, path


def pack(archive: Path, files: Sequence[Path], exclude: Sequence[str] = ()) -> None:
    """``files`` (each under its own name; a folder with everything under it) into ``archive``, reproducibly: names
    sorted, times 0, owner root, modes 0644/0755, gzip without a time or a name, so the same data gives the same bytes."""
    members = sorted(m for f in files for m in _members(Path(f), Path(f).name, exclude))
    names = [name for name, _ in members]
    doubled = sorted({n for n in names if names.count(n) > 1})
    if doubled:
        raise ValueError(f"{archive}: two of the files to pack have the same name: {', '.join(doubled)}")
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for name, path in members:
                info = tarfile.TarInfo(name)
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                if path.is_dir():
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
                    continue
                data = path.read_bytes()
                info.size, info.mode = len(data), 0o755 if os.access(path, os.X_OK) else 0o644
                tar.addfile(info, io.BytesIO(data))
    archive.write_bytes(buffer.getvalue())


def _free_run_folder(text: str) -> Path:
    path = Path(text)
    if not RUN_NAME.match(path.name):
        raise ValueError(f"{text}: a run's folder is named DATE-MACHINE[-x], e.g. 2026-12-04-h100")
    if (path / "manifest.json").exists():
        raise ValueError(f"{text}: a run is there already (its manifest.json)")
    return path


def run_folder(text: str) -> Path:
    """A folder a run can be written to (``--record DIR``): named ``DATE-MACHINE[-x]`` and holding no run yet.

    Checked when the program starts, so a long benchmark never ends on a folder it cannot write."""
    try:
        return _free_run_folder(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def write_run(folder: Path | str, experiment: str, machine: str, command: str, summary: str, files: Sequence[Path],
              *, exclude: Sequence[str] = (), extra: Mapping[str, Any] | None = None) -> Path:
    """Make the run folder ``folder``: ``raw.tar.gz`` of ``files`` and ``manifest.json`` with :data:`MANIFEST_KEYS`
    (the date is the folder's, the commit this checkout's) plus ``extra`` (e.g. a reader's ``parts``)."""
    path = _free_run_folder(str(folder))
    if not files:
        raise ValueError(f"{path}: no files given: a run keeps its raw data")
    missing = [str(f) for f in files if not Path(f).exists()]
    if missing:
        raise FileNotFoundError(f"{path}: nothing to pack at {', '.join(missing)}")
    inside = [str(f) for f in files if path.resolve() in (Path(f).resolve(), *Path(f).resolve().parents)]
    if inside:
        raise ValueError(f"{path}: the raw data must lie outside the run's folder, not at {', '.join(inside)}")
    path.mkdir(parents=True, exist_ok=True)
    pack(path / "raw.tar.gz", files, exclude)
    manifest = {"experiment": experiment, "machine": machine, "date": RUN_NAME.match(path.name).group(1),  # type: ignore[union-attr]
                "commit": commit(), "command": command, "summary": summary, "raw": "raw.tar.gz",
                "read": f"python benchmarks/figures.py benchmarks/results/{experiment}/{path.name}", **(extra or {})}
    (path / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    log.info("run written to %s", path)
    return path


def add_record_arguments(parser: argparse.ArgumentParser) -> None:
    """``--record DIR`` and ``--machine``: a benchmark program writes its run's folder when asked."""
    parser.add_argument("--record", type=run_folder, metavar="DIR",
                        help="write the run's folder there: manifest.json and raw.tar.gz (see benchmarks/figures.py)")
    parser.add_argument("--machine", default="", help="the manifest's machine (default: the GPUs, else the CPU cores)")


def record(args: argparse.Namespace, experiment: str, files: Sequence[Path], summary: str,
           exclude: Sequence[str] = (), **extra: Any) -> Path | None:
    """The run's folder, written where ``--record`` says (None when it was not given)."""
    if args.record is None:
        return None
    return write_run(args.record, experiment, args.machine or machine(), command_line(), summary, files,
                     exclude=exclude, extra=extra)


def _extra(text: str) -> tuple[str, Any]:
    """``KEY=JSON`` of ``--extra``: a manifest key a reader needs beyond :data:`MANIFEST_KEYS` (``parts``, ``gpus``)."""
    key, sep, value = text.partition("=")
    if not sep or not key or key in MANIFEST_KEYS:
        raise argparse.ArgumentTypeError(f"{text}: KEY=JSON with a key other than {', '.join(MANIFEST_KEYS)}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text}: the value is not JSON ({e})") from None


def main(argv: Sequence[str] | None = None) -> int:
    """``record``: a run's folder from a shell script (``python3 benchmarks/readers/common.py record ...``)."""
    parser = argparse.ArgumentParser(description="Write a benchmark run's folder: manifest.json and raw.tar.gz.")
    sub = parser.add_subparsers(dest="verb", required=True)
    rec = sub.add_parser("record", help="pack FILE... into DIR/raw.tar.gz beside DIR/manifest.json")
    rec.add_argument("folder", type=run_folder, metavar="DIR")
    rec.add_argument("files", nargs="+", type=Path, metavar="FILE")
    rec.add_argument("--experiment", required=True)
    rec.add_argument("--command", required=True, help="what ran")
    rec.add_argument("--summary", required=True, help="what it gave, in one line")
    rec.add_argument("--machine", default="", help="default: the GPUs nvidia-smi lists, else the CPU's cores")
    rec.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="names left out (repeatable)")
    rec.add_argument("--extra", action="append", default=[], type=_extra, metavar="KEY=JSON",
                     help="a further manifest key, e.g. gpus=1 or parts='[[\"solo\", \"solo\"]]' (repeatable)")
    args = parser.parse_args(argv)
    folder = write_run(args.folder, args.experiment, args.machine or machine(), args.command, args.summary,
                       args.files, exclude=args.exclude, extra=dict(args.extra))
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
