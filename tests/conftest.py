"""Shared fixtures. GPU tests are skipped without a CUDA checkpoint-capable GPU, visibly."""

from __future__ import annotations

import importlib.util
import os

import pytest


def _gpu_available() -> tuple[bool, str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        driver = pynvml.nvmlSystemGetDriverVersion()
        pynvml.nvmlShutdown()
    except Exception as exc:  # no driver, no GPU
        return False, f"no NVIDIA GPU/driver here ({type(exc).__name__}: {exc})"
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
