"""pytest fixtures for plugin authors (loaded through the ``pytest11`` entry point).

**Strict by default**: a lifecycle made by ``timeslice_lifecycle`` fails its test when any plugin raised in any
hook. An observing hook's error is only logged in a trainer (the run goes on), so without this a test whose
plugin prints and then raises would pass. A test that expects hook errors says so: the marker
``@pytest.mark.timeslice_hook_errors`` (the whole test) or ``timeslice_lifecycle(plugin, strict=False)`` (one
lifecycle); the errors are in ``lifecycle.manager.hook_errors`` to assert on.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import pytest

from timeslice_verl.hooks.lifecycle import Lifecycle
from timeslice_verl.testing.recording import RecordingPlugin, make_lifecycle

MARKER = "timeslice_hook_errors"
"""The opt-out: this test expects plugins to raise in hooks."""
_STRICT = pytest.StashKey[list]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}: the test expects hook errors; timeslice's test kit does not fail it for them")


@pytest.fixture
def timeslice_recorder() -> RecordingPlugin:
    """A fresh :class:`~timeslice_verl.testing.RecordingPlugin`."""
    return RecordingPlugin()


@pytest.fixture
def timeslice_lifecycle(timeslice_recorder: RecordingPlugin, request: pytest.FixtureRequest
                        ) -> Callable[..., Lifecycle]:
    """Factory: ``timeslice_lifecycle(my_plugin, ..., strict=True)`` → a Lifecycle with the recorder registered
    first. Strict (the default unless the test carries the ``timeslice_hook_errors`` marker): any hook error
    fails the test."""
    watched: list[Lifecycle] = request.node.stash.setdefault(_STRICT, [])
    lenient = request.node.get_closest_marker(MARKER) is not None

    def factory(*plugins: Any, strict: bool | None = None, **kwargs: Any) -> Lifecycle:
        lifecycle = make_lifecycle(timeslice_recorder, *plugins, **kwargs)
        if strict if strict is not None else not lenient:
            watched.append(lifecycle)
        return lifecycle

    return factory


def _describe(errors: list[Any]) -> str:
    first = errors[0]
    lines = [f"timeslice test kit (strict): {len(errors)} hook error(s); a plugin that raises fails the test"]
    lines += [f"  plugin {e.plugin!r} raised in {e.hook}: {e.error!r}" for e in errors]
    lines.append(f"mark the test @pytest.mark.{MARKER} (or timeslice_lifecycle(..., strict=False)) if it expects "
                 "them. The first one:")
    lines.append("".join(traceback.format_exception(type(first.error), first.error, first.error.__traceback__)))
    return "\n".join(lines)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):  # type: ignore[no-untyped-def]
    """After the test body: fail it on the hook errors of its strict lifecycles (its own failure goes first)."""
    result = yield
    errors = [e for lifecycle in item.stash.get(_STRICT, []) for e in lifecycle.manager.hook_errors]
    if errors:
        pytest.fail(_describe(errors), pytrace=False)
    return result
