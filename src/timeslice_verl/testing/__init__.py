"""Helpers for testing hook plugins — yours and ours.

* :class:`RecordingPlugin` records every hook call it receives;
* :func:`make_lifecycle` builds the real plugin manager and dispatcher around your plugins, with
  no verl and no agent;
* :func:`fake_event_sequence` / :func:`play` replay what a fully-async trainer fires in a run
  (init, pre-fit sync, steps, an optional save and an optional crash).

They are also pytest fixtures (``timeslice_recorder``, ``timeslice_lifecycle``) through the
``pytest11`` entry point, so a plugin package's tests need no set-up. ``fake_vllm`` is a stand-in
vLLM HTTP server for tests and dry runs; it is never the tenant of a real run.
"""

from timeslice_verl.testing.recording import (
    FakeTrainer,
    RecordingPlugin,
    fake_event_sequence,
    make_lifecycle,
    play,
)

__all__ = ["FakeTrainer", "RecordingPlugin", "fake_event_sequence", "make_lifecycle", "play"]
