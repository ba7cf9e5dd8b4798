"""The launcher's checks of verl's real config, before Ray starts: an adapter this verl cannot run, and verl's
profiler on steps whose GPU time-slicing may lend away, are refused with the key that is wrong."""

from __future__ import annotations

import pytest

from timeslice_verl.config.schema import ConfigError, enabled_settings

pytestmark = pytest.mark.verl


def compose_verl(overrides: list[str]):
    from verl_harness import compose

    return compose(overrides)


def test_the_hooked_adapter_on_stock_verl_is_refused_before_launch():
    from importlib.metadata import version

    from timeslice_verl.adapters.preflight import preflight

    for name in ("hooked", "fork"):  # fork: its former name
        with pytest.raises(ConfigError, match=rf"^timeslice.adapter: is 'hooked', but the installed verl \(verl "
                                              rf"{version('verl')}\) has no fully-async lifecycle hooks .*lacks "
                                              r"register_trainer\): .*Use timeslice.adapter=auto"):
            preflight(compose_verl(["+timeslice=interleave", f"timeslice.adapter={name}"]))
    for name in ("auto", "stock"):
        preflight(compose_verl(["+timeslice=interleave", f"timeslice.adapter={name}"]))


def test_the_hooked_adapter_passes_on_a_verl_with_the_hooks():
    import verl_hooked_standin as hooked_verl

    from timeslice_verl.adapters.preflight import check_hooked

    settings = enabled_settings(compose_verl(["+timeslice=interleave", "timeslice.adapter=hooked"]))
    assert settings is not None
    check_hooked(settings, hooked_verl)  # the fork's registry and on_* methods: accepted


def test_a_registry_without_every_hook_is_named():
    from types import SimpleNamespace

    from timeslice_verl.adapters.hooked import missing_hooks

    class Trainer:
        async def on_init_workers_begin(self) -> None: ...

    module = SimpleNamespace(register_trainer=lambda name: None, FullyAsyncTrainer=Trainer)
    assert missing_hooks(module)[:2] == ["on_init_workers_end", "on_sample_end"]
    assert missing_hooks(SimpleNamespace(register_trainer=lambda name: None)) == ["FullyAsyncTrainer"]


def test_verl_profiling_steps_are_refused_while_the_gpu_may_be_lent():
    from timeslice_verl.adapters.preflight import preflight

    with pytest.raises(ConfigError, match=r"^global_profiler.steps: is \[1, 3\]: verl profiles the trainer's workers "
                                          r"on those steps, while time-slicing may have lent their GPU"):
        preflight(compose_verl(["+timeslice=interleave", "global_profiler.steps=[1,3]"]))
    preflight(compose_verl(["+timeslice=interleave", "global_profiler.steps=[]"]))  # none: nothing profiled
    preflight(compose_verl(["+timeslice=interleave"]))  # verl's default: null
    preflight(compose_verl(["+timeslice=observe", "global_profiler.steps=[1,3]"]))  # observe-only lends nothing
    preflight(compose_verl(["global_profiler.steps=[1,3]"]))  # no time-slicing: verl's own business
