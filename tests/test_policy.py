"""The arbitration policy, table-driven: a situation in, the one next move out."""

from __future__ import annotations

import pytest

from timeslice_verl.agent.policy import (
    ASLEEP,
    AWAKE,
    DEAD,
    FAULTED,
    FROZEN,
    TENANT_FAULTED,
    TRANSITIONING,
    JobView,
    Move,
    MoveKind,
    World,
    desired,
    next_move,
)


def J(name="a", **kw) -> JobView:
    return JobView(name=name, **kw)


CASES = [
    # (situation, expected move, why)
    (World(), None, "nothing to do"),
    (World(tenant=ASLEEP), Move(MoveKind.tenant_reclaim), "nobody wants the GPU: the tenant gets it back"),
    (World(tenant=ASLEEP, room_for_tenant=False), None, "no room: the tenant stays asleep"),
    (World(tenant=TENANT_FAULTED), Move(MoveKind.tenant_reclaim), "a faulted tenant is retried"),
    (World(tenant=DEAD), None, "a dead tenant is ignored"),
    (World(tenant=TENANT_FAULTED, now=5.0, tenant_retry_at=6.0), None, "a failing tenant is retried only after its backoff"),
    (World(tenant=TENANT_FAULTED, now=7.0, tenant_retry_at=6.0), Move(MoveKind.tenant_reclaim), "backoff over: retry"),
    (World(jobs=(J(queued=True),), queue_head="a", tenant=TENANT_FAULTED, now=1.0, tenant_retry_at=9.0), Move(MoveKind.grant, "a"),
     "a faulted tenant never makes the trainer wait"),
    (World(jobs=(J(),), tenant=ASLEEP), Move(MoveKind.freeze, "a"), "an idle running job is frozen before the tenant wakes"),
    (World(jobs=(J(state=FROZEN),), tenant=ASLEEP), Move(MoveKind.tenant_reclaim), "frozen job, sleeping tenant: wake it"),
    (World(jobs=(J(holding=True),), tenant=AWAKE), Move(MoveKind.tenant_yield), "a holder never shares with an awake tenant"),
    (World(jobs=(J(queued=True),), queue_head="a", tenant=AWAKE), Move(MoveKind.tenant_yield), "the trainer first: tenant yields"),
    (World(jobs=(J(state=FROZEN, queued=True),), queue_head="a", tenant=ASLEEP), Move(MoveKind.thaw, "a", waiting=True),
     "a waiting frozen job is thawed"),
    (World(jobs=(J(queued=True),), queue_head="a", tenant=ASLEEP), Move(MoveKind.grant, "a"), "a waiting running job is granted"),
    (World(jobs=(J(state=FAULTED, queued=True),), queue_head="a"), Move(MoveKind.recover, "a", waiting=True),
     "a faulted job that waits is recovered"),
    (World(jobs=(J(holding=True),)), None, "the holder owns the GPU: nothing moves"),
    (World(jobs=(J("a", holding=True), J("b"))), Move(MoveKind.freeze, "b"), "another idle job is frozen under a holder"),
    (World(jobs=(J("a", state=FROZEN, queued=True), J("b", queued=True)), queue_head="a"), Move(MoveKind.freeze, "b"),
     "FIFO: the head's rival is frozen first"),
    (World(jobs=(J("a", state=FROZEN, prepared_until=9.0),), tenant=AWAKE, now=5.0), Move(MoveKind.tenant_yield),
     "a prepare makes the job the desired owner: the tenant yields early"),
    (World(jobs=(J("a", state=FROZEN, prepared_until=9.0),), tenant=ASLEEP, now=5.0), Move(MoveKind.thaw, "a"),
     "a prepare restores without anyone waiting"),
    (World(jobs=(J("a", state=FROZEN, prepared_until=4.0),), tenant=ASLEEP, now=5.0), Move(MoveKind.tenant_reclaim),
     "an expired prepare counts for nothing"),
    (World(jobs=(J(refused=True),), tenant=ASLEEP), None, "a refused freeze keeps the job on the GPU, the tenant asleep"),
    (World(jobs=(J(state=TRANSITIONING),), tenant=ASLEEP), Move(MoveKind.tenant_reclaim), "a job mid-move is not moved again"),
    (World(jobs=(J(ending=True),), tenant=ASLEEP), Move(MoveKind.forget, "a"), "an ended job is forgotten, not frozen"),
    (World(jobs=(J(ending=True, state=FROZEN),)), Move(MoveKind.thaw_ended, "a"), "an ended frozen job is thawed first"),
    (World(jobs=(J(ending=True, state=FROZEN, has_pids=False),)), Move(MoveKind.forget, "a"), "nothing left to thaw"),
    (World(jobs=(J(ending=True, holding=True),)), None, "an ended job that still holds keeps the GPU"),
    (World(tenant=AWAKE, tenant_warm_up=True), Move(MoveKind.tenant_warm_up), "a new tenant is warmed up while nobody asks"),
    (World(jobs=(J(state=FROZEN),), tenant=AWAKE, tenant_warm_up=True), Move(MoveKind.tenant_warm_up),
     "a frozen job leaves the GPU to the tenant: it can warm up"),
    (World(jobs=(J(queued=True),), queue_head="a", tenant=AWAKE, tenant_warm_up=True), Move(MoveKind.tenant_yield),
     "a trainer that asks comes before the warm-up"),
    (World(jobs=(J(),), tenant=AWAKE, tenant_warm_up=True), Move(MoveKind.freeze, "a"), "an idle job is frozen before the warm-up"),
    (World(jobs=(J(refused=True),), tenant=AWAKE, tenant_warm_up=True), None,
     "a job whose freeze was refused is on the GPU: no warm-up beside it"),
    (World(tenant=ASLEEP, tenant_warm_up=True), Move(MoveKind.tenant_reclaim), "only an awake tenant warms up"),
]


@pytest.mark.parametrize("world, move, why", CASES, ids=[c[2] for c in CASES])
def test_next_move(world, move, why):
    got = next_move(world)
    assert got == move, why
    assert got is None or type(got.kind) is MoveKind, "a move's kind is the enum, from the policy to the arbiter"


def test_desired_owner_order():
    holder, head, early, late = J("h", holding=True), J("q", queued=True), J("e", prepared_until=3.0), J("l", prepared_until=8.0)
    assert desired(World(jobs=(late, early, head, holder), queue_head="q", now=1.0)) == holder
    assert desired(World(jobs=(late, early, head), queue_head="q", now=1.0)) == head
    assert desired(World(jobs=(late, early), now=1.0)) == early
    assert desired(World(jobs=(late, early), now=9.0)) is None


def test_the_policy_is_pure():
    import ast
    import inspect

    import timeslice_verl.agent.policy as policy

    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(ast.parse(inspect.getsource(policy))) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in (n.names if isinstance(n, ast.Import) else [None])}
    assert imported <= {"__future__", "dataclasses", "enum"}, imported
