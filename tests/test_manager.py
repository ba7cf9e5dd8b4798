"""The plugin manager: sources, enable/disable, load-time validation."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from timeslice_verl import hookimpl
from timeslice_verl.config.schema import PluginSettings
from timeslice_verl.hooks.manager import PluginLoadError, TimesliceManager


def make_distribution(root: Path, dist: str, module: str, source: str, entry: str) -> None:
    """An installed-looking distribution (``*.dist-info`` with an entry point) on ``root``."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[timeslice_verl]\n{entry}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("tsplug_")]:
        del sys.modules[name]


def test_entry_point_plugin_is_discovered_and_called(site):
    make_distribution(
        site, "tsplug-counter", "tsplug_counter",
        """
        from timeslice_verl import hookimpl
        CALLS = []
        @hookimpl
        def post_rollout(event):
            CALLS.append(event.samples)
        """,
        "counter = tsplug_counter",
    )
    manager = TimesliceManager().load(PluginSettings(), bundled=())
    info = {p.name: p for p in manager.plugins()}
    assert info["counter"].source.startswith("entry point tsplug-counter ")
    assert info["counter"].hooks == ("post_rollout",)

    from timeslice_verl.hooks.events import RolloutEvent

    manager.hook.post_rollout(trainer=None, event=RolloutEvent(job="j", samples=7))
    import tsplug_counter

    assert tsplug_counter.CALLS == [7]


def test_entry_point_class_is_instantiated_and_can_be_disabled(site):
    make_distribution(
        site, "tsplug-cls", "tsplug_cls",
        """
        from timeslice_verl import hookimpl
        class Plugin:
            def __init__(self):
                self.seen = []
            @hookimpl
            def pre_train_step(self, event):
                self.seen.append(event.step)
        """,
        "cls = tsplug_cls:Plugin",
    )
    manager = TimesliceManager().load(PluginSettings(), bundled=())
    assert type(manager.get("cls")).__name__ == "Plugin"
    manager = TimesliceManager().load(PluginSettings(disabled=["cls"]), bundled=())
    assert manager.get("cls") is None
    manager = TimesliceManager().load(PluginSettings(enabled=[]), bundled=())
    assert manager.get("cls") is None


def test_enabled_names_a_missing_entry_point(site):
    with pytest.raises(PluginLoadError, match="no-such-plugin"):
        TimesliceManager().load(PluginSettings(enabled=["no-such-plugin"]), bundled=())


def test_misspelled_hook_fails_at_load_naming_it(site):
    make_distribution(
        site, "tsplug-typo", "tsplug_typo",
        """
        from timeslice_verl import hookimpl
        @hookimpl
        def pre_trian_step(event):
            pass
        """,
        "typo = tsplug_typo",
    )
    with pytest.raises(PluginLoadError) as err:
        TimesliceManager().load(PluginSettings(), bundled=())
    assert "pre_trian_step" in str(err.value)
    assert "did you mean 'pre_train_step'" in str(err.value)
    assert "'typo'" in str(err.value)


def test_config_module_plugin_with_attr(site):
    (site / "tsplug_cfg.py").write_text(textwrap.dedent(
        """
        from timeslice_verl import hookimpl
        class Recorder:
            @hookimpl
            def weight_sync_end(self, event):
                pass
        recorder = Recorder()
        """
    ))
    manager = TimesliceManager().load(PluginSettings(modules=["tsplug_cfg:recorder"]), bundled=())
    assert manager.get("tsplug_cfg:recorder") is sys.modules["tsplug_cfg"].recorder


@pytest.mark.parametrize(
    "spec, message",
    [("tsplug_nope", "cannot import module 'tsplug_nope'"), ("json:nope", "has no attribute 'nope'")],
)
def test_config_module_errors_name_the_plugin(site, spec, message):
    with pytest.raises(PluginLoadError, match=message):
        TimesliceManager().load(PluginSettings(modules=[spec]), bundled=())


def test_wrong_hook_arguments_are_rejected():
    class Bad:
        @hookimpl
        def pre_train_step(self, event, gpu):
            pass

    with pytest.raises(PluginLoadError, match="gpu"):
        TimesliceManager().register(Bad(), "bad")


def test_a_wrapper_sees_every_plugins_outcome_under_the_hooks_error_policy():
    seen = []

    class Wrapper:
        @hookimpl(wrapper=True)
        def save_checkpoint_begin(self, event):
            results = yield
            seen.append(results)
            return results

    class Veto:
        @hookimpl
        def save_checkpoint_begin(self, event):
            return False

    class Broken:
        @hookimpl
        def post_rollout(self, event):
            raise RuntimeError("observing hooks report this and go on")

    class Counter:
        calls = 0

        @hookimpl
        def post_rollout(self, event):
            Counter.calls += 1
            return "counted"

    manager = TimesliceManager()
    for name, plugin in [("wrapper", Wrapper()), ("veto", Veto()), ("broken", Broken()), ("counter", Counter())]:
        manager.register(plugin, name)
    manager.check()
    assert manager.call("save_checkpoint_begin", trainer=None, event=None) == [False]
    assert seen == [[False]]
    assert manager.call("post_rollout", trainer=None, event=None) == ["counted"]  # Broken is logged, Counter still ran


def test_registering_never_modifies_the_plugin_or_pluggys_records():
    class Plugin:
        @hookimpl
        def post_rollout(self, event):
            return 1

    plugin = Plugin()
    manager = TimesliceManager()
    manager.register(plugin, "p")
    assert manager.get("p") is plugin
    assert type(plugin).__dict__["post_rollout"] is Plugin.__dict__["post_rollout"]
    with pytest.raises(PluginLoadError, match="already registered as 'p'"):
        manager.register(plugin, "again")


def test_a_nested_hook_call_is_traced_with_its_own_duration_and_the_outer_one_with_its_whole(caplog):
    """The agent plugin fires ``handoff`` inside ``pre_train_step``: each gets its own time."""
    import logging

    now = [100.0]
    manager = TimesliceManager()

    class Outer:
        @hookimpl
        def pre_train_step(self, event):
            now[0] += 0.5
            manager.call("handoff", trainer=None, event=None)
            now[0] += 0.1

    class Inner:
        @hookimpl
        def handoff(self, event):
            now[0] += 0.02

    manager.register(Outer(), "outer")
    manager.register(Inner(), "inner")
    manager.trace(logging.getLogger("timeslice.trace.test"), clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="timeslice.trace.test"):
        manager.call("pre_train_step", trainer=None, event=None)
    lines = [r.getMessage() for r in caplog.records if r.name == "timeslice.trace.test"]
    assert lines[0].startswith("handoff [inner]") and lines[0].endswith("(20.0 ms)"), lines
    assert lines[1].startswith("pre_train_step [outer]") and lines[1].endswith("(620.0 ms)"), lines
