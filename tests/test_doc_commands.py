"""Every shell block of the README, the guides and hooks/ runs as written.

A newcomer copies these blocks; each one (```bash, ```sh, ```console) is run with ``bash -euo pipefail`` on a copy
of the repository (its tracked and unignored files, no ``.venv``), bounded by a timeout, in the environment the
docs promise: the README's first command's ``.venv`` (it runs first, really: install and demo), on the PATH as
when activated, and nothing of the test's own interpreter. A block may leave nothing running behind it.

A block that cannot run here says why in the markdown, right above it:
``<!-- doc-run: skip KIND: reason -->``, KIND one of :data:`KINDS`; it is skipped with that reason.

The runs take minutes, so they carry the ``docs`` marker, which the default run leaves out (``addopts``) and
``.ci/run`` runs as a step of its own (``python -m pytest -m docs``). The checks of the markers themselves, and that
``.ci/run`` runs exactly the README's test line, are fast and run by default.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
KINDS = {
    "gpu": "needs an NVIDIA GPU (and what runs on it: vLLM, verl, the CUDA backend's agent)",
    "vllm": "needs a real vLLM",
    "kubernetes": "needs a Kubernetes cluster",
    "docker": "builds images with docker and pushes them to a registry",
    "verl": "installs verl and torch (GBs of wheels)",
    "ci": "is the test suite itself, which holds this runner: .ci/run runs it",
}
MARKER = re.compile(r"<!--\s*doc-run:\s*skip\s+([a-z]+):\s*(.+?)\s*-->")
FENCE = re.compile(r"^```(bash|sh|console)\s*$")
FIRST = ("README.md", 8)
"""The README's first block: install and demo, which every other block's environment comes from."""


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    text: str
    skip: tuple[str, str] | None

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "guides").rglob("*.md")), *sorted((ROOT / "hooks").rglob("*.md"))]


def blocks(doc: Path) -> list[Block]:
    """The shell blocks of ``doc``, each with the skip marker right above it (the previous non-blank line)."""
    lines = doc.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            m = MARKER.search(prev)
            out.append(Block(str(doc.relative_to(ROOT)), i + 1, "\n".join(lines[i + 1:end]) + "\n",
                             (m.group(1), m.group(2)) if m else None))
            i = end
        i += 1
    return out


ALL = [b for doc in documents() for b in blocks(doc)]


def test_the_first_block_is_the_readmes_install_and_demo():
    first = ALL[0]
    assert (first.doc, first.line) == FIRST and first.skip is None
    assert ".venv/bin/pip install '.[batch]' && .venv/bin/timeslice-verl demo" in first.text


def test_every_marker_names_a_known_kind_and_sits_on_a_shell_block():
    marked = {b.name for b in ALL if b.skip}
    for doc in documents():
        lines = doc.read_text().splitlines()
        for n, line in enumerate(lines, 1):
            if "<!--" not in line or "doc-run" not in line:
                continue
            m = MARKER.search(line)
            assert m, f"{doc.name}:{n}: not a doc-run marker: {line!r}"
            assert m.group(1) in KINDS, f"{doc.name}:{n}: kind {m.group(1)!r} is none of {sorted(KINDS)}"
            following = next(k for k in range(n, len(lines)) if lines[k].strip())
            assert f"{doc.relative_to(ROOT)}:{following + 1}" in marked, f"{doc.name}:{n}: no shell block right below"


def test_ci_runs_exactly_the_readmes_test_line():
    (suite,) = [b for b in ALL if b.doc == "README.md" and b.skip and b.skip[0] == "ci"]
    (line,) = [x for x in suite.text.splitlines() if x.strip() and not x.startswith("#")]
    assert line in (ROOT / ".ci" / "run").read_text().splitlines()


def _heading_above(block: Block) -> str:
    """The ``## `` heading of the section a block sits in."""
    lines = (ROOT / block.doc).read_text().splitlines()[:block.line]
    return next((x for x in reversed(lines) if x.startswith("## ")), "")


def test_the_batch_cluster_script_is_the_guides_block():
    (block,) = [b for b in ALL if b.doc == "guides/batch-cluster.md" and not b.skip
                and _heading_above(b) == "## Try it on one machine"]
    script = (ROOT / "guides" / "batch-cluster" / "try-on-one-machine.sh").read_text()
    assert script.endswith("set -euo pipefail\nset -o xtrace\n" + block.text)


# ---------------------------------------------------------------------------------------------- running them


def _copy(dest: Path) -> Path:
    """The working tree's tracked and unignored files (what a clone has, with this tree's edits)."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _environment(repo: Path, scratch: Path) -> dict[str, str]:
    """The shell of a reader who ran the README's first command and activated its .venv: the copy's .venv first on
    the PATH, none of this interpreter's (its virtualenv, PYTHONPATH); a runtime and state folder of its own."""
    ours = {str(Path(sys.executable).parent), os.environ.get("VIRTUAL_ENV", "") + "/bin"}
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p not in ours]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTEST_ADDOPTS")}
    run_dir = scratch / "xdg-run"
    run_dir.mkdir(mode=0o700)
    env.update(PATH=os.pathsep.join([str(repo / ".venv" / "bin"), *path]), VIRTUAL_ENV=str(repo / ".venv"),
               XDG_RUNTIME_DIR=str(run_dir), XDG_STATE_HOME=str(scratch / "xdg-state"),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _leftovers(sid: int) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                out.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


@dataclass
class Outcome:
    rc: int
    output: str
    why: str = ""


class Runner:
    """Runs blocks once each, a document's earlier blocks first (a reader goes down the page), the README's
    install and demo before all."""

    def __init__(self, repo: Path, scratch: Path) -> None:
        self.repo, self.env = repo, _environment(repo, scratch)
        self.done: dict[str, Outcome] = {}

    def outcome(self, block: Block) -> Outcome:
        first = next(b for b in ALL if (b.doc, b.line) == FIRST)
        before = [first] + [b for b in ALL if b.doc == block.doc and b.line < block.line and not b.skip]
        for earlier in before:
            if earlier is not block and earlier.name not in self.done:
                self.done[earlier.name] = self._run(earlier)
            if earlier is not block and self.done[earlier.name].rc != 0:
                return Outcome(1, self.done[earlier.name].output, f"{earlier.name}, which comes first, failed")
        if block.name not in self.done:
            self.done[block.name] = self._run(block)
        return self.done[block.name]

    def _run(self, block: Block) -> Outcome:
        limit = 900 if (block.doc, block.line) == FIRST else 600
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block.text], cwd=self.repo, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, why = proc.communicate(timeout=limit)[0], ""
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, why = proc.communicate()[0], f"still running after {limit} s"
        stray = _leftovers(proc.pid)
        for p in stray:
            p.kill()
        if stray and not why:
            why = "left running: " + ", ".join(" ".join(p.cmdline()[:4]) for p in stray if p.is_running())
        return Outcome(proc.returncode if not why else 1, output, why)


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    scratch = tmp_path_factory.mktemp("doc-run")
    return Runner(_copy(scratch / "repo"), scratch)


@pytest.mark.docs
@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("block", ALL, ids=[b.name for b in ALL])
def test_the_block_runs_as_written(block: Block, runner: Runner) -> None:
    if block.skip:
        kind, reason = block.skip
        pytest.skip(f"{kind}: {reason}")
    result = runner.outcome(block)
    assert result.rc == 0 and not result.why, (
        f"{block.name} {result.why or f'exited {result.rc}'}:\n{block.text}\n--- its output (the end):\n"
        f"{result.output[-6000:]}")
