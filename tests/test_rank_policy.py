"""verl's ranks as the policy tenant's weight source: every rank takes part in gathering a due version,
rank 0 keeps it and answers with its update bodies, every rank drops it once pushed; the driver's source picks rank
0's answer, and says clearly what is missing when it cannot."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch", reason="the ranks' tensors are torch tensors (the 'verl' extra brings torch)")

from timeslice_verl.names import POLICY_RELEASE, POLICY_SNAPSHOT  # noqa: E402
from timeslice_verl.ranks import policy  # noqa: E402
from timeslice_verl.ranks.worker import install_worker_methods  # noqa: E402
from timeslice_verl.validate.verl_source import RankSourceError, ranks  # noqa: E402
from timeslice_verl.weights import WeightsError  # noqa: E402


class Engine:
    """verl's engine as a rank sees it: ``get_per_tensor_param`` yields full tensors one at a time (a collective)."""

    def __init__(self, device: str = "cpu") -> None:
        self.tensors = {"w": torch.ones(4, 4, device=device), "b": torch.zeros(4, device=device)}
        self.gathered: list[str] = []

    def get_per_tensor_param(self):
        def gen():
            for name, t in self.tensors.items():
                self.gathered.append(name)
                yield name, t
        return gen(), None


def worker(device: str = "cpu") -> types.SimpleNamespace:
    return types.SimpleNamespace(actor=types.SimpleNamespace(engine=Engine(device)))


def test_a_rank_other_than_0_takes_part_in_the_gather_and_keeps_nothing():
    w = worker()
    report = policy.snapshot_here(w, 4, rank=1)
    assert w.actor.engine.gathered == ["w", "b"], "every tensor gathered: the collective needs every rank"
    assert report["updates"] == [] and report["tensors"] == 2 and 4 not in policy._KEPT
    assert policy.release_here(w, 4)["released"] is False


def test_rank_0_refuses_tensors_off_the_gpu_and_keeps_nothing():
    with pytest.raises(WeightsError, match="IPC handles are for CUDA tensors"):
        policy.snapshot_here(worker(), 6, rank=0)
    assert 6 not in policy._KEPT


def test_a_worker_without_verls_engine_is_named():
    with pytest.raises(RuntimeError, match="get_per_tensor_param"):
        policy.snapshot_here(types.SimpleNamespace(actor=None), 2, rank=0)


@pytest.mark.gpu
def test_rank_0_keeps_a_copy_of_the_version_and_answers_with_ipc_handles():
    w = worker("cuda")
    report = policy.snapshot_here(w, 8, rank=0)
    assert [u["info"]["names"] for u in report["updates"]] == [["w", "b"]] and report["bytes"] == (16 + 4) * 4
    w.actor.engine.tensors["w"].add_(1)  # the next step changes the originals, not the kept version
    assert float(policy._KEPT[8][0][1].sum()) == 16.0
    assert policy.release_here(w, 8)["released"] and 8 not in policy._KEPT


class Group:
    """verl's actor worker group: a ONE_TO_ALL method answers one report per rank."""

    def __init__(self, reports: list) -> None:
        self.reports, self.released = reports, []

    def timeslice_policy_snapshot(self, version: int) -> list:
        return self.reports

    def timeslice_policy_release(self, version: int) -> list:
        self.released.append(version)
        return []


def test_the_driver_takes_rank_0s_updates_and_releases_on_every_rank():
    body = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4]], "packed": False, "ipc_handles_pickled": "x"}
    group = Group([{"rank": 1, "updates": []}, {"rank": 0, "updates": [{"info": body, "bytes": 8}]}])
    snap = ranks(types.SimpleNamespace(actor_wg=group)).snapshot(2)
    assert [(u.info, u.bytes) for u in snap.updates()] == [(body, 8)]
    snap.release()
    assert group.released == [2]


@pytest.mark.parametrize("trainer, says", [
    (types.SimpleNamespace(), "none of actor_wg, actor_rollout_wg"),
    (types.SimpleNamespace(actor_wg=object()), "verl.plugins entry point"),
])
def test_a_trainer_whose_ranks_cannot_give_weights_is_named(trainer, says):
    with pytest.raises(RankSourceError, match=says):
        ranks(trainer)


def test_rank_0_without_weights_is_an_error_not_an_empty_push():
    with pytest.raises(RankSourceError, match="rank 0 sent no weights for version 2"):
        ranks(types.SimpleNamespace(actor_wg=Group([{"rank": 0, "updates": []}]))).snapshot(2)


def test_the_policy_methods_are_added_to_verls_worker_with_the_others():
    calls = []

    class Worker:
        pass

    def register(dispatch_mode):
        calls.append(dispatch_mode)
        return lambda fn: fn

    module = types.SimpleNamespace(__name__="fake", Worker=Worker, register=register,
                                   Dispatch=types.SimpleNamespace(ONE_TO_ALL="one-to-all"))
    install_worker_methods(module)
    assert hasattr(Worker, POLICY_SNAPSHOT) and hasattr(Worker, POLICY_RELEASE)
    assert set(calls) == {"one-to-all"}
