"""Helpers for testing hook plugins — yours and ours.

* :class:`RecordingPlugin` records every hook call it receives;
* :func:`make_lifecycle` builds the real plugin manager and dispatcher around your plugins, with
  no verl and no agent;
* :func:`fake_event_sequence` / :func:`play` replay what a fully-async trainer fires in a run
  (init, pre-fit sync, steps, an optional save and an optional crash).

They are also pytest fixtures (``timeslice_recorder``, ``timeslice_lifecycle``) through the
``pytest11`` entry point, so a plugin package's tests need no set-up. The stand-in vLLM HTTP server that
tests run is a product command of its own, :mod:`timeslice_verl.standin`: the test kit uses the product, never
the reverse.
"""

from timeslice_verl.testing.recording import (
    FakeTrainer,
    RecordingPlugin,
    fake_event_sequence,
    make_lifecycle,
    play,
)

__all__ = ["FakeTrainer", "RecordingPlugin", "fake_event_sequence", "make_lifecycle", "play"]
