"""GPU tests (H200 machine): real CUDA checkpoint/restore through the agent's API.

Run there with ``python -m pytest -m gpu -s``; CI has no GPU and skips them with the reason.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = pytest.mark.gpu

GIB = 2**30


def test_cuda_backend_checkpoints_and_restores_a_torch_process_through_the_agent(tmp_path):
    pytest.importorskip("torch")
    import handoff

    results = handoff.run("cuda", "cuda", gib=8.5, cycles=3, workdir=tmp_path)
    print("\n" + handoff.table(results))
    out = os.environ.get("TIMESLICE_BENCH_OUT")
    if out:
        Path(out).write_text(json.dumps(results, indent=1, default=str))
    assert len(results["cycles"]) == 3, Path(results["agent_log"]).read_text()[-3000:]
    assert results["gpu_bytes_before"] >= 8 * GIB
    for cycle in results["cycles"]:
        assert cycle["bytes"] >= 8 * GIB, "the freeze parked the worker's memory"
        assert cycle["gpu_bytes_frozen"] is not None and cycle["gpu_bytes_frozen"] < 0.5 * GIB, "NVML: memory freed"
        assert cycle["gpu_bytes_restored"] >= 0.95 * cycle["bytes"], "NVML: memory returned"
        assert cycle["data_intact"], "data survived checkpoint/restore"
        assert cycle["step_after_restore"].startswith("done"), "the worker computes again after restore"
        assert cycle["lock_s"] > 0 and cycle["checkpoint_s"] > 0 and cycle["restore_s"] > 0 and cycle["unlock_s"] > 0
    assert results["agent_exit"] == 0 and results["checksum_after_agent_stop"]
