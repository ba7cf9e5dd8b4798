"""Validation in the valleys through the stock adapter, on verl's real FullyAsyncTrainer (GPU work faked at the
boundaries, as in tests/verl_harness.py): with ``trainer.test_freq=2`` the versions 2, 4, 6 are pushed into the
policy tenant (the stand-in vLLM), run as batches of the real batch service, answered entirely by their version,
scored with verl's reward function and logged at their step — and ``_fit_validate`` never waits for them."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

pytestmark = pytest.mark.verl

ray = pytest.importorskip("ray")
pytest.importorskip("verl")
pd = pytest.importorskip("pandas")

import verl_harness as h  # noqa: E402
from batch_support import BatchServiceProc  # noqa: E402
from verl.experimental.fully_async_policy import fully_async_trainer as verl_trainer_module  # noqa: E402

from timeslice_verl import hookimpl  # noqa: E402
from timeslice_verl.standin.server import StandinServer  # noqa: E402
from timeslice_verl.validate.policy import Update  # noqa: E402


class _Snap:
    def __init__(self, version: int) -> None:
        self.version = version

    def updates(self):
        yield Update({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]], "packed": False,
                      "ipc_handles_pickled": f"v{self.version}"}, 8)

    def release(self) -> None:
        pass


class TestWeights:
    """The trainer's weight source in this test (on a GPU: its ranks' tensors as IPC handles)."""

    __test__ = False

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def snapshot(self, version: int) -> _Snap:
        ORDER.append(("snapshot", version))
        return _Snap(version)


def weights(trainer) -> TestWeights:  # timeslice.validate.source=test_validate_verl:weights
    return TestWeights(trainer)


ORDER: list[tuple[str, int]] = []
"""Snapshots of the weights and ends of weight syncs, in the order they happened (the trainer runs in this process)."""


class _SyncEnds:
    @hookimpl
    def weight_sync_end(self, event) -> None:
        ORDER.append(("weight_sync_end", event.param_version))


sync_ends = _SyncEnds()  # timeslice.plugins.modules=[test_validate_verl:sync_ends]


class Tracker:
    """verl's tracker, recording: every call of ``log`` in order (training steps and validations)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict]] = []
        self.threads: set[int] = set()

    def log(self, data: dict, step: int) -> None:
        self.calls.append((step, dict(data)))
        self.threads.add(threading.get_ident())

    def validated(self) -> list[int]:
        return [step for step, data in self.calls if "timeslice/validate/version" in data]


def validated_runs(trainer) -> set[int]:
    """The versions whose validation run has ended (the validator's own record; its metrics are logged at the
    trainer's next step, on its thread)."""
    validator = trainer.__dict__.get("_timeslice_validator")
    return {r.version for r in validator.runs} if validator is not None else set()


class PacedQueue(h.FakeMessageQueueClient):
    """The rollout, paced so that each step's samples come once every due version before it has been validated: the
    sequence is the same on a loaded machine (the trainer never waits for validation; the rollout does, here)."""

    def __init__(self, samples: int, required: int, trainer) -> None:
        super().__init__(samples)
        self.required, self.trainer = required, trainer

    async def get_sample(self):
        step = self.served // self.required + 1  # the step these samples are for
        due = {v for v in range(2, step) if v % 2 == 0}
        while not due <= validated_runs(self.trainer):
            await asyncio.sleep(0.02)
        return await super().get_sample()


@pytest.fixture
def world(tmp_path, procs):
    users, policy = StandinServer(model="m").start(), StandinServer(model="policy", token_s=0.002).start()
    service = BatchServiceProc(tmp_path / "svc", users.url, extra=(f"timeslice.validate.policy_url={policy.url}",)).start()
    procs.append(service)
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"#### {i if i % 2 else 100}"}],
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}} for i in range(4)]
    pd.DataFrame(rows).to_parquet(tmp_path / "val.parquet")
    yield service, policy, tmp_path / "val.parquet"
    users.stop()
    policy.stop()


def _config(tmp_path, service, policy, val, finish_s: float = 60.0):
    return h.trainer_config(tmp_path, trigger=1, extra=[
        "trainer.test_freq=2", f"data.val_files={val}", "actor_rollout_ref.rollout.val_kwargs.n=1",
        "data.max_response_length=4", "timeslice.validate.enable=true", f"timeslice.validate.policy_url={policy.url}",
        f"timeslice.validate.service_url={service.url}", "timeslice.validate.source=test_validate_verl:weights",
        f"timeslice.batch.key_file={service.key_file}", "timeslice.validate.poll_s=0.05",
        f"timeslice.validate.finish_s={finish_s}"])


def test_due_versions_are_validated_by_the_policy_tenant_and_logged_at_their_step(ray_local, world, tmp_path):
    service, policy, val = world
    trainer = h.build_trainer(verl_trainer_module.FullyAsyncTrainer, _config(tmp_path, service, policy, val), steps=6)
    tracker = trainer.logger = Tracker()
    trainer.set_message_queue_client(PacedQueue(trainer.required_samples * 6, trainer.required_samples, trainer))
    asyncio.run(h.run_like_fully_async_main(trainer))
    assert tracker.validated() == [2, 4, 6]
    assert tracker.threads == {threading.get_ident()}, "verl's tracker is called on the trainer's thread alone"
    for step, data in tracker.calls:
        if "timeslice/validate/version" in data:
            assert data["timeslice/validate/version"] == step
            assert data["val-core/openai/gsm8k/reward/mean@1"] == pytest.approx(0.5)  # the odd prompts are right
    client = service.http()
    runs = [b for b in client.get("/v1/batches").json()["data"] if (b.get("metadata") or {}).get("timeslice_validation_version")]
    for b in runs:
        text = client.get(f"/v1/files/{b['output_file_id']}/content").text
        versions = {json.loads(x)["response"]["body"]["timeslice_weight_version"] for x in text.split("\n") if x}
        assert versions == {int(b["metadata"]["timeslice_validation_version"])}, "a run answered by its version alone"
    assert sorted(int(b["metadata"]["timeslice_validation_version"]) for b in runs) == [2, 4, 6]
    timeline = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().split("\n") if x]
    ended = [r for r in timeline if r["hook"] == "validation_end"]
    assert [(r["version"], r["status"], r["answers"], r["error"]) for r in ended] == [(v, "completed", 4, "") for v in (2, 4, 6)]
    assert all(r["metrics"]["val-core/openai/gsm8k/reward/mean@1"] == pytest.approx(0.5) for r in ended)
    assert policy.engine.stats()["completed"] == 12 and not ray.get(trainer.rollouter.get_saved.remote()) is None


def test_a_due_versions_weights_are_taken_before_the_end_of_its_sync_can_lend_the_gpu(ray_local, world, tmp_path):
    """The end of a weight sync may lend the trainer's GPUs; the ranks' CUDA calls for a due version's weights must
    come before it (after it, they waited for the trainer's next acquire, and the trainer with them)."""
    service, policy, val = world
    ORDER.clear()
    config = _config(tmp_path, service, policy, val)
    config.timeslice.plugins.modules = ["test_validate_verl:sync_ends"]
    config.trainer.val_before_train = True
    trainer = h.build_trainer(verl_trainer_module.FullyAsyncTrainer, config, steps=4)
    trainer.logger = Tracker()
    trainer.set_message_queue_client(PacedQueue(trainer.required_samples * 4, trainer.required_samples, trainer))
    asyncio.run(h.run_like_fully_async_main(trainer))
    for version in (0, 2, 4):
        assert ORDER.index(("snapshot", version)) < ORDER.index(("weight_sync_end", version)), (version, ORDER)
    assert [v for kind, v in ORDER if kind == "snapshot"] == [0, 2, 4], "each due version taken once"


def test_fit_validate_does_not_wait_for_a_validation(ray_local, world, tmp_path):
    """The policy tenant takes the weights but never answers a request: training still runs to its end, every step
    logged, the validations submitted and none logged (they cannot finish; the trainer did not wait for them)."""
    service, policy, val = world
    policy.engine.faults.hang = "v1/chat/completions"
    trainer = h.build_trainer(verl_trainer_module.FullyAsyncTrainer,
                              _config(tmp_path, service, policy, val, finish_s=0.0), steps=4)
    tracker = trainer.logger = Tracker()
    asyncio.run(h.run_like_fully_async_main(trainer))
    steps = sorted({step for step, data in tracker.calls if "timeslice/validate/version" not in data})
    assert steps[-1] >= 4 and tracker.validated() == []
    assert policy.engine.stats()["weights"]["version"] == 2, "version 2 pushed, its run never answered"


# --------------------------------------------------------------------------- verl's v1 trainer


def test_the_v1_trainer_validates_before_training_and_every_test_freq_through_the_policy_tenant(world, tmp_path,
                                                                                                   monkeypatch):
    import v1_harness as v1
    from verl.trainer.ppo.v1 import trainer_base

    from agent_support import eventually

    service, policy, val = world
    tracker = Tracker()
    monkeypatch.setattr(trainer_base, "Tracking", lambda **kw: tracker)
    fakes = v1.Fakes(monkeypatch, steps=4)
    sample = fakes.buffer.sample

    def paced(global_steps, partition_id, batch_size):  # each step's batch once the validations due before it ran
        due = {0} | {v for v in range(2, global_steps) if v % 2 == 0}
        eventually(lambda: due <= validated_runs(trainer), what=f"validations {sorted(due)} run")
        return sample(global_steps, partition_id, batch_size)

    fakes.buffer.sample = paced
    config = v1.v1_config(tmp_path, sync_step=1, extra=[
        "trainer.val_before_train=True", "trainer.test_freq=2", f"data.val_files={val}",
        "actor_rollout_ref.rollout.val_kwargs.n=1", "data.max_response_length=4", "timeslice.validate.enable=true",
        f"timeslice.validate.policy_url={policy.url}", f"timeslice.validate.service_url={service.url}",
        "timeslice.validate.source=test_validate_verl:weights", f"timeslice.batch.key_file={service.key_file}",
        "timeslice.validate.poll_s=0.05", "timeslice.validate.finish_s=60"])
    trainer = v1.build(config, fakes)
    v1.run(trainer, fakes)
    assert tracker.validated() == [0, 2, 4] and tracker.threads == {threading.get_ident()}
    assert all(d["timeslice/validate/version"] == s for s, d in tracker.calls if "timeslice/validate/version" in d)
    submitted = {s: d["timeslice/validate/submitted"] for s, d in tracker.calls if "timeslice/validate/submitted" in d}
    assert submitted == {0: 0.0, 2: 2.0, 4: 4.0}, "verl logs the submission where it logged its awaited validation"


def test_a_policy_tenant_that_is_down_costs_the_validation_never_the_training(ray_local, world, tmp_path):
    """No server at the policy tenant's address: every due version is reported unvalidated (the timeline says why)
    and training runs to its end."""
    service, policy, val = world
    policy.stop()
    trainer = h.build_trainer(verl_trainer_module.FullyAsyncTrainer,
                              _config(tmp_path, service, policy, val, finish_s=0.0), steps=4)
    tracker = trainer.logger = Tracker()
    asyncio.run(h.run_like_fully_async_main(trainer))
    assert max(step for step, _ in tracker.calls) >= 4 and tracker.validated() == []
    timeline = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().split("\n") if x]
    ended = [(r["version"], "PolicyError" in r["error"]) for r in timeline if r["hook"] == "validation_end"]
    assert ended == [(2, True), (4, True)]
