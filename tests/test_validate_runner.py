"""Validation runs in the background against the real batch service and the stand-in policy tenant: each due
version pushed, run as a batch answered entirely by that version, scored with verl's reward function and logged at
its step; a version due while a run is under way is held until it ends."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from agent_support import eventually
from batch_support import BatchServiceProc
from timeslice_verl.batch.client import BatchClient
from timeslice_verl.standin.server import StandinServer
from timeslice_verl.validate.policy import PolicyTenant, Update
from timeslice_verl.validate.runner import Validator
from timeslice_verl.validate.valset import Prompt, Sampling

pytest.importorskip("verl", reason="validation scores with verl's reward functions (the verl extra)")


class Weights:
    """A trainer's weights as a test holds them: names and shapes; a snapshot keeps the version it was taken at."""

    def __init__(self) -> None:
        self.taken: list[int] = []
        self.released: list[int] = []

    def snapshot(self, version: int):
        self.taken.append(version)
        outer = self

        class Snap:
            def updates(self):
                yield Update({"names": ["w", "b"], "dtype_names": ["float32"] * 2, "shapes": [[2, 2], [2]],
                              "packed": False, "ipc_handles_pickled": f"v{version}"}, 24)

            def release(self):
                outer.released.append(version)

        return Snap()


PROMPTS = [Prompt(str(i), "openai/gsm8k", [{"role": "user", "content": f"#### {i if i % 2 else 100}"}], str(i))
           for i in range(6)]  # the stand-in echoes the prompt: odd ones carry the right answer


@pytest.fixture
def world(tmp_path, procs):
    users, policy = StandinServer(model="m").start(), StandinServer(model="policy", token_s=0.002).start()
    service = BatchServiceProc(tmp_path, users.url, extra=(f"timeslice.validate.policy_url={policy.url}",)).start()
    procs.append(service)
    yield service, policy
    users.stop()
    policy.stop()


def _validator(service, policy, logged, weights, score=None, **kw) -> Validator:
    from verl.utils.reward_score import default_compute_score

    return Validator(every=2, policy=PolicyTenant(policy.url), batch=BatchClient(service.url, service.key),
                     source=weights, prompts=PROMPTS, sampling=Sampling(n=2, max_tokens=4),
                     score=score or default_compute_score, model="policy",
                     log_metrics=lambda m, step: logged.append((step, m)), poll_s=0.05, **kw)


def _versions_answered(service, batch_id: str) -> set:
    client = service.http()
    batch = client.get(f"/v1/batches/{batch_id}").json()
    text = client.get(f"/v1/files/{batch['output_file_id']}/content").text
    return {json.loads(x)["response"]["body"]["timeslice_weight_version"] for x in text.split("\n") if x}


def test_each_due_version_is_pushed_run_scored_and_logged_at_its_step(world):
    service, policy = world
    logged, weights = [], Weights()
    v = _validator(service, policy, logged, weights)
    try:
        moves = [str(v.synced(n)) for n in (1, 2)]
        eventually(lambda: len(logged) == 1, what="version 2 validated")
        moves += [str(v.synced(n)) for n in (3, 4)]
        eventually(lambda: len(logged) == 2, what="version 4 validated")
    finally:
        runs = v.close(wait_s=30)
    assert moves == ["none", "push", "none", "push"] and weights.taken == [2, 4] and weights.released == [2, 4]
    assert [step for step, _ in logged] == [2, 4]
    for step, m in logged:
        assert m["timeslice/validate/version"] == step
        assert m.get("val-core/openai/gsm8k/reward/mean@2") == pytest.approx(0.5), m  # odd prompts right, both answers
    assert [r.version for r in runs] == [2, 4] and not any(r.error for r in runs)
    assert [_versions_answered(service, r.batch_id) for r in runs] == [{2}, {4}], "each run answered by its version"


def test_a_version_due_while_a_run_is_under_way_is_held_until_it_ends(world):
    from verl.utils.reward_score import default_compute_score

    service, policy = world
    scoring, go_on = threading.Event(), threading.Event()

    def score(**kw):  # version 2's run stays under way (scoring) until version 4 has been due
        scoring.set()
        go_on.wait(60)
        return default_compute_score(**kw)

    logged, weights = [], Weights()
    v = _validator(service, policy, logged, weights, score=score)
    try:
        assert str(v.synced(2)) == "push"
        eventually(scoring.is_set, what="version 2's answers being scored")
        assert str(v.synced(4)) == "hold" and weights.released == [2], "4 kept, 2 released once pushed"
        go_on.set()
        eventually(lambda: len(logged) == 2, what="both validated", timeout=120)
    finally:
        go_on.set()
        runs = v.close(wait_s=30)
    assert [r.version for r in runs] == [2, 4] and [str(x) for x in v.schedule.late] == [
        "the validation of version 2 was still running when version 4 was due"]
    updates = policy.engine.stats()["weights"]["updates"]
    assert [(u["version"], u["generating"]) for u in updates] == [(2, 0), (4, 0)], "4 pushed after 2's run ended"
    assert [_versions_answered(service, r.batch_id) for r in runs] == [{2}, {4}]
