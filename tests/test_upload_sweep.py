"""Chunks of an upload that stopped (its client or its replica killed) are dropped while the service runs, not only
when a replica starts; an upload still being written is kept, however long ago its first chunk was written."""

from __future__ import annotations

import time

from timeslice_verl.batch.files import Files
from timeslice_verl.batch.store import Store


def _chunk(store: Store, fid: str, seq: int, at: float) -> None:
    with store.transaction() as db:
        db.execute("INSERT INTO file_chunks (file_id, seq, data, at) VALUES (?, ?, ?, ?)", (fid, seq, b"x", at))


def _chunks(store: Store) -> set[str]:
    return {r["file_id"] for r in store.query("SELECT DISTINCT file_id FROM file_chunks")}


def test_an_upload_written_to_lately_is_kept_whatever_its_first_chunks_age(tmp_path):
    store = Store(tmp_path / "b.sqlite")
    _chunk(store, "file_stopped", 0, 1.0)
    _chunk(store, "file_long", 0, 1.0)  # a long upload: its first chunk old, its last one just written
    _chunk(store, "file_long", 1, time.time())
    assert Files(store).sweep(idle_s=3600) == 1
    assert _chunks(store) == {"file_long"}
    store.close()


def test_the_running_service_sweeps_the_chunks_of_an_upload_that_stopped(tmp_path, procs):
    from agent_support import eventually
    from batch_support import BatchServiceProc

    api = BatchServiceProc(tmp_path, "", command=("serve", "--api-only"),
                           extra=("timeslice.batch.upload_idle_s=1",)).start()
    procs.append(api)
    store = Store(api.db)
    _chunk(store, "file_killed", 0, 1.0)  # written long ago by an upload whose client was killed
    eventually(lambda: "file_killed" not in _chunks(store), what="the stopped upload's chunks swept")
    store.close()
