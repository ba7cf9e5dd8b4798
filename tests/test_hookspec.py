"""The hookspec: every hook documented, names stable, gating set coherent."""

from __future__ import annotations

import re
from pathlib import Path

from timeslice_verl.hooks import spec as hookspecs
from timeslice_verl.hooks.reference import hook_reference_markdown

REFERENCE = Path(__file__).resolve().parents[1] / "guides" / "hook-reference.md"
DESIGN_EVENTS = {
    "init_workers_begin", "init_workers_end", "post_rollout", "pre_train_step",
    "weight_sync_begin", "weight_sync_end", "save_checkpoint_begin", "trainer_exception",
}


def test_every_hook_has_a_docstring():
    for cls in hookspecs.SPEC_CLASSES:
        for name in (n for n in vars(cls) if not n.startswith("_")):
            doc = getattr(cls, name).__doc__ or ""
            assert len(doc.strip()) > 40, f"{cls.__name__}.{name} needs a docstring that says when it fires"


def test_every_hook_is_in_the_reference_page():
    text = REFERENCE.read_text()
    documented = set(re.findall(r"^### `(\w+)`", text, flags=re.M))
    missing = set(hookspecs.hook_names()) - documented
    assert not missing, f"guides/hook-reference.md lacks {sorted(missing)}: run `timeslice-verl hooks --markdown`"
    stale = documented - set(hookspecs.hook_names())
    assert not stale, f"guides/hook-reference.md documents hooks that no longer exist: {sorted(stale)}"


def test_reference_page_is_up_to_date():
    assert REFERENCE.read_text() == hook_reference_markdown(), (
        "regenerate: timeslice-verl hooks --markdown > guides/hook-reference.md"
    )


def test_design_events_are_all_hooks():
    assert DESIGN_EVENTS <= set(hookspecs.hook_names())
    assert hookspecs.GATING_HOOKS <= set(hookspecs.hook_names())
