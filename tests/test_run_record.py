"""A benchmark writes its own run's folder: a manifest saying what ran, and the raw data packed so that the same data
always gives the same archive (a re-recorded run differs in git only where its data did)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the benchmarks import their siblings

from readers import common  # noqa: E402


def _raw(tmp_path: Path) -> list[Path]:
    out = tmp_path / "out"
    (out / "part" / "inner").mkdir(parents=True)
    (out / "rows.json").write_text('{"rows": [1, 2]}\n')
    (out / "part" / "run.jsonl").write_text('{"t": 1}\n')
    (out / "part" / "inner" / "agent.log").write_text("agent\n")
    (out / "part" / "db.sqlite").write_text("not kept\n")
    (out / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(out / "run.sh", 0o755)
    return sorted(out.iterdir())


def test_a_written_run_has_every_manifest_key_and_opens_with_its_raw_data(tmp_path):
    folder = common.write_run(tmp_path / "soak" / "2026-12-04-cpu", "soak", "CPU, 2 cores", "python x.py --n 3",
                              "3 of 3", _raw(tmp_path), exclude=["*.sqlite"], extra={"parts": [["part", "one"]]})
    manifest = json.loads((folder / "manifest.json").read_text())
    assert list(manifest)[:len(common.MANIFEST_KEYS)] == list(common.MANIFEST_KEYS)
    assert manifest["experiment"] == "soak" and manifest["date"] == "2026-12-04" and manifest["summary"] == "3 of 3"
    assert manifest["commit"] and manifest["parts"] == [["part", "one"]] and manifest["raw"] == "raw.tar.gz"
    run = common.open_run(folder)
    assert json.loads((run.data / "rows.json").read_text()) == {"rows": [1, 2]}
    assert (run.data / "part" / "inner" / "agent.log").read_text() == "agent\n"
    assert not (run.data / "part" / "db.sqlite").exists()


def test_the_archive_is_the_same_bytes_whenever_the_same_data_is_packed(tmp_path):
    files = _raw(tmp_path)
    first = common.write_run(tmp_path / "a" / "2026-12-04-cpu", "e", "m", "c", "s", files)
    for f in files:  # newer times, another order: the archive does not change
        os.utime(f, (2_000_000_000, 2_000_000_000))
    second = common.write_run(tmp_path / "b" / "2026-12-04-cpu", "e", "m", "c", "s", list(reversed(files)))
    assert (first / "raw.tar.gz").read_bytes() == (second / "raw.tar.gz").read_bytes()
    with tarfile.open(first / "raw.tar.gz") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted(m.name for m in members)
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}
    assert {m.name: m.mode for m in members}["run.sh"] == 0o755
    assert (first / "raw.tar.gz").read_bytes()[4:8] == b"\0\0\0\0"  # gzip's own time field


@pytest.mark.parametrize(("name", "files", "error", "says"), [
    pytest.param("results-today", None, ValueError, "named DATE-MACHINE", id="a folder not named by its date"),
    pytest.param("2026-12-04-cpu", [], ValueError, "no files given", id="nothing to pack"),
    pytest.param("2026-12-04-cpu", ["missing.json"], FileNotFoundError, "missing.json", id="a file that is not there"),
])
def test_a_run_that_cannot_be_written_is_refused_naming_why(tmp_path, name, files, error, says):
    given = _raw(tmp_path) if files is None else [tmp_path / f for f in files]
    with pytest.raises(error, match=says):
        common.write_run(tmp_path / name, "e", "m", "c", "s", given)
    assert not (tmp_path / name / "manifest.json").exists()


def test_a_run_is_never_written_over_nor_packed_from_inside_itself(tmp_path):
    folder = common.write_run(tmp_path / "2026-12-04-cpu", "e", "m", "c", "s", _raw(tmp_path))
    before = (folder / "manifest.json").read_bytes()
    with pytest.raises(ValueError, match="a run is there already"):
        common.write_run(folder, "e", "m", "c", "other", _raw(tmp_path / "again"))
    assert (folder / "manifest.json").read_bytes() == before
    inside = tmp_path / "2026-12-05-cpu"
    inside.mkdir()
    (inside / "rows.json").write_text("{}")
    with pytest.raises(ValueError, match="outside the run's folder"):
        common.write_run(inside, "e", "m", "c", "s", [inside / "rows.json"])


def test_a_program_checks_its_record_folder_when_it_starts_and_records_what_it_was_given(tmp_path):
    parser = argparse.ArgumentParser()
    common.add_record_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--record", str(tmp_path / "latest")])
    assert common.record(parser.parse_args([]), "e", [], "s") is None
    args = parser.parse_args(["--record", str(tmp_path / "2026-12-04-h100"), "--machine", "1 x H100"])
    folder = common.record(args, "e", _raw(tmp_path), "s")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["machine"] == "1 x H100" and manifest["command"].startswith("python ")


def test_the_command_names_the_program_by_its_path_in_the_repository():
    script = common.ROOT / "benchmarks" / "ladder.py"
    assert common.command_line([str(script), "--json", "a b.json"]) == "python benchmarks/ladder.py --json 'a b.json'"


def test_a_shell_script_records_its_run_through_the_command_line(tmp_path):
    files = [str(f) for f in _raw(tmp_path)]
    got = subprocess.run([sys.executable, str(common.ROOT / "benchmarks" / "readers" / "common.py"), "record",
                          str(tmp_path / "2026-12-04-h200"), *files, "--experiment", "verl-run", "--command",
                          "bash one_gpu.sh 3", "--summary", "s", "--machine", "1 x H200", "--exclude", "*.sqlite",
                          "--extra", "gpus=1", "--extra", 'parts=[["solo", "solo"]]'],
                         capture_output=True, text=True, timeout=120, check=False)
    assert got.returncode == 0, got.stderr
    manifest = json.loads((tmp_path / "2026-12-04-h200" / "manifest.json").read_text())
    assert {k: manifest[k] for k in ("experiment", "machine", "command", "gpus", "parts")} == {
        "experiment": "verl-run", "machine": "1 x H200", "command": "bash one_gpu.sh 3", "gpus": 1,
        "parts": [["solo", "solo"]]}
    refused = subprocess.run([sys.executable, str(common.ROOT / "benchmarks" / "readers" / "common.py"), "record",
                              str(tmp_path / "2026-12-04-h200"), *files, "--experiment", "e", "--command", "c",
                              "--summary", "s"], capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode == 2 and "a run is there already" in refused.stderr


@pytest.mark.parametrize("given", ["parts", "summary=\"x\"", "parts=[solo]"])
def test_a_further_manifest_key_must_be_json_and_not_one_of_the_keys_every_run_has(tmp_path, capsys, given):
    with pytest.raises(SystemExit) as exit_:
        common.main(["record", str(tmp_path / "2026-12-04-h200"), *map(str, _raw(tmp_path)), "--experiment", "e",
                     "--command", "c", "--summary", "s", "--extra", given])
    assert exit_.value.code == 2 and f"{given}: " in capsys.readouterr().err
    assert not (tmp_path / "2026-12-04-h200").exists()
