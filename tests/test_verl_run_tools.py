"""The validated run's helpers: the reward a random model can earn, and the learning-curve plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "verl_run"))

import curves  # noqa: E402
import reward  # noqa: E402


@pytest.mark.parametrize(
    ("response", "score"),
    [("", 0.0), ("abcd", 0.0), ("a1b2", 0.5), ("2026", 1.0), ("#### 42\n", 0.25)],
)
def test_reward_is_the_share_of_digits(response, score):
    assert reward.compute_score("openai/gsm8k", response, "42") == pytest.approx(score)


def test_random_responses_get_different_rewards():
    """GRPO needs rewards that differ within a group, or every advantage is 0."""
    group = ["x9 q", "zz zz", "7 7 7", "id_3"]
    assert len({reward.compute_score("openai/gsm8k", r, "") for r in group}) > 1


def _log(path: Path, steps: dict[int, tuple[float, float]]) -> None:
    path.mkdir()
    lines = ["(FullyAsyncTrainer pid=1) some other line"]
    lines += [f"step:{n} - actor/grad_norm:{g} - critic/score/mean:{s} - timing_s/step:1.0" for n, (s, g) in steps.items()]
    (path / "verl.log").write_text("\n".join(lines) + "\n")


def test_curves_of_two_runs_in_one_plot(tmp_path):
    _log(tmp_path / "solo", {1: (0.1, 0.5), 2: (0.2, 0.4)})
    _log(tmp_path / "interleave", {1: (0.1, 0.6), 2: (0.25, 0.3), 3: (0.3, 0.2)})
    out = tmp_path / "curves.png"
    curves.plot(out, [tmp_path / "solo", tmp_path / "interleave"])
    assert out.stat().st_size > 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["solo"]["critic/score/mean"] == [[1, 0.1], [2, 0.2]]
    assert data["interleave"]["actor/grad_norm"] == [[1, 0.6], [2, 0.3], [3, 0.2]]


ROOT = Path(__file__).resolve().parent.parent
FULLY_ASYNC = "verl.experimental.fully_async_policy.fully_async_main"


def run_sh_calls(tmp_path: Path, mode: str, **env: str) -> list[tuple[dict[str, str], str]]:
    """Every command run.sh starts, as (the environment it names, its argv): run with a stand-in interpreter that
    only records them."""
    import os
    import shlex
    import subprocess

    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"CVD=${{CUDA_VISIBLE_DEVICES:-}} ROLE=${{TIMESLICE_RUN_ROLE:-}} $*\" >> "
                    f"{shlex.quote(str(calls))}\n")
    fake.chmod(0o755)
    full = dict(os.environ, PYTHON=str(fake), MODEL=str(tmp_path / "model"), DATA=str(tmp_path / "data"),
                OUT=str(tmp_path / "out"), REWARD="benchmarks/verl_run/reward.py", **env)
    full.pop("CUDA_VISIBLE_DEVICES", None)
    subprocess.run(["bash", "benchmarks/verl_run/run.sh", mode], cwd=ROOT, env=full, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = []
    for line in calls.read_text().splitlines():
        cvd, role, argv = line.split(" ", 2)
        out.append(({"CUDA_VISIBLE_DEVICES": cvd.partition("=")[2], "TIMESLICE_RUN_ROLE": role.partition("=")[2]}, argv))
    return out


def verl_overrides(calls: list[tuple[dict[str, str], str]], entry: str) -> tuple[dict[str, str], list[str]]:
    env, line = next((e, c) for e, c in calls if c.startswith(f"-m {entry} "))
    return env, line.split()[2:]  # run.sh passes no value with a space in it


@pytest.mark.verl
@pytest.mark.parametrize("trainer", ["fully_async", "v1"])
def test_run_sh_hands_verl_a_config_it_composes_and_the_preflight_accepts(tmp_path, monkeypatch, trainer):
    """run.sh's verl command line, for either trainer, is one verl's own Hydra config takes, with the
    interleave section and the learnable reward; captured by a stand-in interpreter that records its argv."""
    pytest.importorskip("verl")
    from timeslice_verl.adapters.preflight import preflight

    root = ROOT
    calls = run_sh_calls(tmp_path, "interleave", TRAINER=trainer, RESPONSE_LEN="1024")
    entry = {"fully_async": FULLY_ASYNC, "v1": "verl.trainer.main_ppo"}[trainer]
    _, overrides = verl_overrides(calls, entry)
    if trainer == "v1":
        import v1_harness as harness
    else:
        import verl_harness as harness
    cfg = harness.compose(overrides)
    preflight(cfg, v1=trainer == "v1")
    assert cfg.timeslice.enabled and cfg.data.max_response_length == 1024
    assert cfg.reward.custom_reward_function.path == str(root / "benchmarks" / "verl_run" / "reward.py")
    assert cfg.actor_rollout_ref.rollout.max_model_len == 256 + 1024
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "nccl"  # the two-GPU layout stays the default


@pytest.mark.verl
@pytest.mark.parametrize("mode", ["solo", "validate"])
def test_run_sh_on_one_gpu_composes_with_the_ipc_engine_and_the_preflight_prepares_ray(tmp_path, monkeypatch, mode):
    """GPUS=1: the same verl line plus the one_gpu option (and time-slicing in validate mode), every vLLM on the one
    GPU with a fixed KV cache, verl with the GPU listed twice; the preflight passes it and would set that itself."""
    pytest.importorskip("verl")
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    import verl_harness
    from timeslice_verl.adapters.preflight import preflight
    from timeslice_verl.weights_ipc.one_gpu import check_keys

    calls = run_sh_calls(tmp_path, mode, GPUS="1", RESPONSE_LEN="512", TEST_FREQ="2", ROLLOUT_STEPS="48")
    env, overrides = verl_overrides(calls, FULLY_ASYNC)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,0"
    cfg = verl_harness.compose(overrides)
    check_keys(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.checkpoint_engine.backend == "timeslice_ipc" and rollout.engine_kwargs.vllm.kv_cache_memory_bytes == 4 << 30
    resolved = cfg.copy()
    OmegaConf.resolve(resolved)  # as fully_async_main does before its workers read the rollout's section
    assert omega_conf_to_dataclass(resolved.actor_rollout_ref.rollout, RolloutConfig).engine_kwargs["vllm"] == {
        "kv_cache_memory_bytes": 4 << 30}
    assert rollout.disable_log_stats is False and cfg.data.seed == 1 and cfg.trainer.test_freq == 2
    assert cfg.rollout.total_rollout_steps == 48 and cfg.data.max_response_length == 512
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    preflight(cfg)
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,0"
    vllms = {e["TIMESLICE_RUN_ROLE"]: (e, c) for e, c in calls if "vllm.entrypoints.openai.api_server" in c}
    if mode == "solo":
        assert "timeslice" not in cfg and vllms == {}
        return
    assert cfg.timeslice.enabled and cfg.timeslice.validate.enable and list(cfg.timeslice.agent.gpus) == [0]
    assert set(vllms) == {"tenant", "policy"}
    for role, gib in (("tenant", 8), ("policy", 4)):
        e, c = vllms[role]
        assert e["CUDA_VISIBLE_DEVICES"] == "0" and f"--kv-cache-memory-bytes {gib << 30}" in c
        assert "--gpu-memory-utilization 0.05" in c


def test_run_sh_refuses_a_gpu_count_it_has_no_layout_for(tmp_path):
    import os
    import subprocess

    done = subprocess.run(["bash", "benchmarks/verl_run/run.sh", "solo"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, GPUS="3", MODEL="m", DATA="d", OUT=str(tmp_path / "out"), PYTHON="false"))
    assert done.returncode == 2 and "GPUS is 3: 2 (trainer and rollout on two GPUs) or 1" in done.stderr



FAULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "verl_run" / "faults.sh"


@pytest.mark.parametrize(("log", "steps"), [(None, "0"), ("", "0"), ("x\n", "0"),
                                             ("a global_steps: 1 local_trigger_step: 1\n" * 3, "3")])
def test_faults_count_the_trainer_steps_as_one_number(tmp_path, log, steps):
    """The step count the faults wait for is one number also before verl logged any step (``grep -c`` prints 0 and
    fails then: a second 0 appended made the wait an error and both faults fire at once)."""
    import subprocess

    if log is not None:
        (tmp_path / "verl.log").write_text(log)
    out = subprocess.run(["bash", "-c", 'source "$1" "$2" sock 1 python3 && steps', "-", str(FAULTS), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == steps + "\n", (out.stdout, out.stderr)
