"""What a rank does at each release: a full garbage collection only when it can free GPU memory."""

from __future__ import annotations

import gc

import pytest

from timeslice_verl.ranks import worker

# GPU bytes live at each release (None: no CUDA in the process) → whether it runs a full collection, and why
CASES = [
    ([10, 10, 10], [True, False, False], "the first release collects; a steady loop never again"),
    ([10, 12, 12], [True, True, False], "more live than after the last collection: cycles may hold tensors"),
    ([10, 8, 9, 9], [True, False, True, False], "growth counts from the lowest since: 8 → 9 collects"),
    ([None, None], [True, True], "without CUDA nothing tells: always"),
]


@pytest.mark.parametrize("lives, collects, why", CASES, ids=[c[2] for c in CASES])
def test_a_full_collection_only_when_the_live_gpu_bytes_grew(monkeypatch, lives, collects, why):
    calls = []
    monkeypatch.setattr(worker, "_COLLECTED_AT", [None])
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or 0)
    seen = []
    for live in lives:
        seen.append(worker.collect_if_grown(None if live is None else (lambda v=live: v)))
    assert seen == collects, why
    assert len(calls) == sum(collects)


def test_release_caches_here_reports_whether_it_collected(monkeypatch):
    monkeypatch.setattr(worker, "_COLLECTED_AT", [None])
    report = worker.release_caches_here()
    assert report["collected"] is True and report["seconds"] >= 0
