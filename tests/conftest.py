"""Shared fixtures. GPU tests are skipped without a CUDA checkpoint-capable GPU, visibly."""

from __future__ import annotations

import atexit
import faulthandler
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Ray started by a test is the test's own: never join a cluster already running on the machine (a developer's
# `ray start`, another test run), which auto-initialising Ray would otherwise do. Tests that build a cluster
# pass its address explicitly.
os.environ["RAY_ADDRESS"] = "local"
# This run's agents take only this run's workers: a second copy of the suite on the same host (same user, same job
# names) is another scope. Every process a test starts inherits it.
os.environ["TIMESLICE_SCOPE"] = f"tests-{os.getpid()}"


def _gpu_available() -> tuple[bool, str]:
    from timeslice_verl.agent.gpu import nvml

    lib, why = nvml()
    if lib is None:  # no driver, no GPU
        return False, f"no NVIDIA GPU/driver here ({why})"
    count = lib.nvmlDeviceGetCount()
    driver = lib.nvmlSystemGetDriverVersion()
    if count < 1:
        return False, "NVML sees no GPU"
    if int(str(driver).split(".")[0]) < 570:
        return False, f"driver {driver} predates the CUDA checkpoint API (r570+)"
    return True, ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ok, why = _gpu_available()
    skip_gpu = pytest.mark.skip(reason=f"gpu test: {why}")
    has_verl = importlib.util.find_spec("verl") is not None
    skip_verl = pytest.mark.skip(reason="verl test: verl is not installed (pip install '.[verl]')")
    for item in items:
        if "gpu" in item.keywords and not ok:
            item.add_marker(skip_gpu)
        if "verl" in item.keywords and not has_verl:
            item.add_marker(skip_verl)


@pytest.fixture(autouse=True)
def _isolated_runtime_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never let a test reach a real agent socket of the user running the tests."""
    runtime = tmp_path_factory.mktemp("xdg")
    os.chmod(runtime, 0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))


@pytest.fixture(autouse=True)
def _run_in_a_temporary_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a test (or a plugin it loads) writes to the working directory lands in its tmp_path."""
    monkeypatch.chdir(tmp_path)


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


@pytest.fixture(autouse=True)
def _ray_left_as_found():
    """A test that started Ray (verl's code may call ``ray.init`` itself) stops it, so the next test's
    ``ray.init`` never finds it running: the suite passes in any order."""
    before = _ray_running()
    yield
    if not before and _ray_running():
        sys.modules["ray"].shutdown()


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for one module's tests on verl's real trainer. Ray's workers import the test harnesses by name,
    as this process does (tests/ on their path): pickling one by value broke when pytest also collected its file
    (its globals hold pytest objects). Logical CPUs: FullyAsyncTrainer asks Ray for num_cpus=10, whatever the machine
    has."""
    ray = pytest.importorskip("ray")
    tests_dir = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH", "")]))
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield
    ray.shutdown()


def _git_status() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=all"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config._timeslice_git_status = _git_status()  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The suite must leave the checkout as it found it (tests once wrote timeslice-handoffs.csv into it)."""
    session.config._timeslice_session = session  # type: ignore[attr-defined]
    before = getattr(session.config, "_timeslice_git_status", None)
    after = _git_status()
    if before is None or after is None or after == before:
        return
    new = sorted(set(after.splitlines()) - set(before.splitlines()))
    if new:
        session.config.get_terminal_writer().line(
            "tests changed the checkout (they must write only into tmp_path): " + "; ".join(new), red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without the interpreter's final teardown once Ray or torch ran in this process.

    Everything is reported by now and the exit handlers (pytest's temporary-directory cleanup, Ray's
    shutdown) still run; what is skipped is the destruction of the objects left in modules, where a
    Ray handle or a torch thread outliving its runtime crashed the process after all tests had passed
    (exit 139 on a 2-core CI machine, about 1 full run in 8). Fatal signals print every thread's stack.
    """
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    if not {"ray", "torch"} & set(sys.modules):
        return
    session = getattr(config, "_timeslice_session", None)
    status = int(session.exitstatus) if session is not None else 0
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@pytest.fixture
def procs():
    """Processes a test starts (workers, agents, stand-in vLLMs); stopped (and continued) afterwards."""
    started: list = []
    yield started
    for p in started:
        try:
            if hasattr(p, "stop"):
                p.stop()
            else:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait(5)
        except Exception:
            pass


@pytest.fixture
def vllm(procs):
    from agent_support import FakeVllmProc

    v = FakeVllmProc()
    procs.append(v)
    return v


@pytest.fixture
def agent(tmp_path, procs, vllm):
    from agent_support import AgentProc

    a = AgentProc(tmp_path, tenant_url=vllm.url).start()
    procs.append(a)
    return a
