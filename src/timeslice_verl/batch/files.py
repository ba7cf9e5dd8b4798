"""Uploaded files, kept in chunks: an upload is written as it arrives and read back as it is needed, so neither an
upload, a download nor a batch's creation holds a whole file (OpenAI takes 200 MB) in memory — the bound is
``timeslice.batch.chunk_mb``.

A file's chunks are written each in its own short transaction (the feeder's writes never wait on an upload) and the
file's row last: a file exists once it is whole. Chunks a killed upload left without a row are swept at start, and
while the service runs once no chunk of that upload was written for ``timeslice.batch.upload_idle_s``.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from timeslice_verl.batch.lines import BatchRefused
from timeslice_verl.batch.store import Store, new_id


class TooLarge(ValueError):
    """An upload past ``timeslice.batch.max_file_mb``."""


class FileGone(BatchRefused):
    """A file deleted while it was read: what was read is not the file (HTTP 409 to a batch's creation)."""


class Files:
    def __init__(self, store: Store) -> None:
        self.store = store

    def sweep(self, idle_s: float = 0.0) -> int:
        """Drop the chunks of uploads that never finished: at one node's start, all of them; where several API
        replicas share the store, those not written to for ``idle_s`` (another replica's upload is under way)."""
        with self.store.transaction() as db:  # an upload's last chunk says when it was written to last
            return db.execute("DELETE FROM file_chunks WHERE file_id IN (SELECT file_id FROM file_chunks WHERE file_id "
                              "NOT IN (SELECT id FROM files) GROUP BY file_id HAVING MAX(at) <= ?)",
                              (time.time() - idle_s,)).rowcount

    def writer(self, max_bytes: int) -> Upload:
        return Upload(self.store, max_bytes)

    def chunks(self, fid: str) -> Iterator[bytes] | None:
        """The file's content, a chunk at a time (each read under the store's lock, none held between); None: no
        such file. A file deleted while it is read raises :class:`FileGone` once that shows (a chunk missing, fewer
        bytes than the file has), so no reader takes a part of a file for the whole of it."""
        rows = self.store.query("SELECT bytes FROM files WHERE id = ?", (fid,))
        return self._chunks(fid, rows[0]["bytes"]) if rows else None

    def _chunks(self, fid: str, size: int) -> Iterator[bytes]:
        seq = got = 0
        while rows := self.store.query("SELECT data FROM file_chunks WHERE file_id = ? AND seq = ?", (fid, seq)):
            data = bytes(rows[0]["data"])
            got += len(data)
            yield data
            seq += 1
        if got != size:
            raise FileGone(f"the input file {fid!r} was deleted while it was read (after {got} of its {size} bytes)",
                           "input_file_id", "file_deleted", status=409)

    def delete(self, fid: str, owner: str | None = None) -> bool:
        """Delete the file (``owner``: only if it is that owner's); whether there was one to delete."""
        with self.store.transaction() as db:
            row = db.execute("SELECT owner FROM files WHERE id = ?", (fid,)).fetchone()
            if row is None or (owner is not None and row["owner"] != owner):
                return False
            db.execute("DELETE FROM file_chunks WHERE file_id = ?", (fid,))
            return db.execute("DELETE FROM files WHERE id = ?", (fid,)).rowcount > 0


class Upload:
    """One upload being written: :meth:`add` each chunk as it arrives, then :meth:`finish` (or :meth:`abandon`)."""

    def __init__(self, store: Store, max_bytes: int) -> None:
        self.store, self.max_bytes = store, max_bytes
        self.fid, self.size, self.seq = new_id("file"), 0, 0

    def add(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.max_bytes:
            self.abandon()
            raise TooLarge(f"the file is larger than {self.max_bytes} bytes (timeslice.batch.max_file_mb)")
        with self.store.transaction() as db:
            db.execute("INSERT INTO file_chunks (file_id, seq, data, at) VALUES (?, ?, ?, ?)",
                       (self.fid, self.seq, data, time.time()))
        self.seq += 1

    def finish(self, purpose: str, filename: str, owner: str = "") -> dict[str, Any]:
        """The file, whole, recorded under ``owner`` (its uploader's key's)."""
        with self.store.transaction() as db:
            db.execute("INSERT INTO files (id, purpose, filename, bytes, created_at, owner) VALUES (?, ?, ?, ?, ?, ?)",
                       (self.fid, purpose, filename, self.size, int(time.time()), owner))
        return self.store.file(self.fid)  # type: ignore[return-value]

    def abandon(self) -> None:
        with self.store.transaction() as db:
            db.execute("DELETE FROM file_chunks WHERE file_id = ?", (self.fid,))


__all__ = ["FileGone", "Files", "TooLarge", "Upload"]
