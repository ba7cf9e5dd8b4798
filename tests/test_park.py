"""Park/unpark of a process's tensors (``timeslice_verl.ranks.park``) on CPU tensors: the same code path a GPU
worker runs, minus the side stream and pinning. The GPU versions are in ``test_gpu.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from timeslice_verl.ranks.park import Parker  # noqa: E402


def _trainer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    model.register_buffer("scale", torch.ones(8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def _step(model, optim, i: int) -> float:
    optim.zero_grad(set_to_none=False)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(i))
    loss = (model(x) * model.scale).pow(2).mean()
    loss.backward()
    optim.step()
    return float(loss.detach())


def _state(model, optim) -> list:
    out = [t.detach().clone() for t in model.state_dict().values()]
    out += [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return out + [v.clone() for s in optim.state.values() for v in s.values()]


def test_twenty_park_cycles_are_bit_identical_and_free_every_storage():
    model, optim = _trainer()
    ref_model, ref_optim = _trainer()
    parker = Parker(device="cpu")
    parker.reserve()
    for i in range(20):
        loss = _step(model, optim, i)
        assert loss == _step(ref_model, ref_optim, i), f"cycle {i}: parking changed the training"
        before = _state(model, optim)
        report = parker.park()
        assert report.parked >= sum(t.numel() * t.element_size() for t in before)
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters()), "storages are freed"
        assert all(v.untyped_storage().nbytes() == 0 for s in optim.state.values() for v in s.values())
        back = parker.unpark()
        assert back.parked == report.parked
        assert all(torch.equal(a, b) for a, b in zip(before, _state(model, optim))), f"cycle {i}: state changed"


def test_reserve_sizes_the_buffer_for_gradients_and_adam_state_so_parks_never_pin():
    model, optim = _trainer()
    parker = Parker(device="cpu")
    pinned = parker.reserve().pinned
    _step(model, optim, 0)  # gradients and the two Adam moments appear only now
    report = parker.park()
    parker.unpark()
    assert report.pin_s == 0.0 and report.pinned == pinned, "the estimate covered the state created by the first step"


def test_a_buffer_that_is_too_small_grows_once():
    model, optim = _trainer()
    parker = Parker(device="cpu")
    parker.reserve(nbytes=4096)
    _step(model, optim, 0)
    first = parker.park()
    parker.unpark()
    second = parker.park()
    parker.unpark()
    assert first.pinned > 4096 and second.pinned == first.pinned, "grown once, then reused"


def test_views_and_tied_weights_share_one_parked_storage():
    model, optim = _trainer()
    model[2].weight = model[2].weight  # a parameter reached twice
    tied = torch.nn.Linear(64, 8)
    tied.weight = model[2].weight  # tied weights: one storage, two modules
    view = model[0].weight[:4]  # a view keeps pointing at its base's storage
    _step(model, optim, 0)
    expected = view.clone()
    tensors = [*model.parameters(), *model.buffers(), *tied.parameters(), view]
    tensors += [p.grad for p in model.parameters()] + [v for s in optim.state.values() for v in s.values()]
    distinct = {t.untyped_storage().data_ptr() for t in tensors}
    parker = Parker(device="cpu")
    parker.scan()
    report = parker.park()
    assert report.storages == len(distinct) < len(tensors), "each storage parked once, however many tensors share it"
    parker.unpark()
    assert torch.equal(view, expected) and tied.weight is model[2].weight


def test_park_and_unpark_are_idempotent():
    model, optim = _trainer()
    parker = Parker(device="cpu")
    parker.scan()
    first = parker.park()
    assert parker.park().parked == 0 and first.parked > 0
    parker.unpark()
    assert parker.unpark().parked == 0
    _step(model, optim, 1)  # the model trains after all of it


def test_a_version_kept_for_the_policy_tenant_is_never_parked():
    """Rank 0 keeps a due version for the policy tenant, which holds IPC handles to it until the push: a park leaves
    those storages in place even where the parker's roots reach them (here the kept tensors share the parameters'
    storages), and parks the rest."""
    from timeslice_verl.ranks import policy

    model, optim = _trainer()
    _step(model, optim, 0)
    policy._KEPT[99] = [(n, p.detach()) for n, p in model.named_parameters()]
    try:
        parker = Parker(device="cpu")
        parker.reserve()
        parker.park()
        assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters()), "the kept version stayed in place"
        assert all(v.untyped_storage().nbytes() == 0 for s in optim.state.values() for v in s.values() if v.dim()), \
            "the rest was parked"
        parker.unpark()
    finally:
        policy._KEPT.pop(99, None)
