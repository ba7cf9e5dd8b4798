"""pytest fixtures for plugin authors (loaded through the ``pytest11`` entry point)."""

from __future__ import annotations

import pytest

from timeslice_verl.testing.recording import RecordingPlugin, make_lifecycle


@pytest.fixture
def timeslice_recorder() -> RecordingPlugin:
    """A fresh :class:`~timeslice_verl.testing.RecordingPlugin`."""
    return RecordingPlugin()


@pytest.fixture
def timeslice_lifecycle(timeslice_recorder: RecordingPlugin):
    """Factory: ``timeslice_lifecycle(my_plugin, ...)`` → a Lifecycle with the recorder registered first."""

    def factory(*plugins, **kwargs):
        return make_lifecycle(timeslice_recorder, *plugins, **kwargs)

    return factory
