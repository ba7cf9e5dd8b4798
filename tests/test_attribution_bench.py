"""benchmarks/attribution.py against the stand-in vLLM: what the service attributes to two owners — their batches'
usage, the summary's owners, the owner metrics — sums to what the tenant itself counted generating."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from agent_support import FakeVllmProc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import attribution  # noqa: E402


def test_every_source_of_the_attribution_sums_to_the_tenants_own_count(tmp_path, procs):
    tenant = FakeVllmProc("--token-s", "0.001")
    procs.append(tenant)
    assert attribution.main(["--vllm-url", tenant.url, "--out", str(tmp_path), "--lines", "30",
                             "--max-tokens", "16"]) == 0
    got = json.loads((tmp_path / "attribution.json").read_text())
    service = [r for r in got["rows"] if r["by_owner"]]
    server = next(r for r in got["rows"] if not r["by_owner"])
    assert [r["source"] for r in service] == ["batch objects' usage", "/timeslice/summary owners",
                                              "metrics, owner label"]
    assert server["output"] == 2 * 30 * 16 == tenant.stats()["generated"]
    for r in service:
        assert (r["input"], r["output"]) == (service[0]["input"], server["output"]), r["source"]
        assert {tuple(v) for v in r["by_owner"].values()} == {(service[0]["input"] / 2, 30 * 16)}, r["source"]
