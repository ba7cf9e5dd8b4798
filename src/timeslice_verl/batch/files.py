"""Uploaded files, kept in chunks: an upload is written as it arrives and read back as it is needed, so neither an
upload, a download nor a batch's creation holds a whole file (OpenAI takes 200 MB) in memory — the bound is
``timeslice.batch.chunk_mb``.

A file's chunks are written each in its own short transaction (the feeder's writes never wait on an upload) and the
file's row last: a file exists once it is whole. Chunks a killed upload left without a row are swept at start, and
while the service runs once no chunk of that upload was written for ``timeslice.batch.upload_idle_s`` (on the
database's clock: the replica that sweeps may not be the one that wrote).
"""

from __future__ import annotations

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
            return db.execute(self.store.dialect.sql("chunks_sweep"), (idle_s,)).rowcount

    def writer(self, max_bytes: int) -> Upload:
        return Upload(self.store, max_bytes)

    def chunks(self, fid: str) -> Iterator[bytes] | None:
        """The file's content, a chunk at a time (each read under the store's lock, none held between); None: no
        such file. A file deleted while it is read raises :class:`FileGone` once that shows (a chunk missing, fewer
        bytes than the file has), so no reader takes a part of a file for the whole of it."""
        rows = self.store.query(self.store.dialect.sql("file_size"), (fid,))
        return self._chunks(fid, rows[0]["bytes"]) if rows else None

    def _chunks(self, fid: str, size: int) -> Iterator[bytes]:
        seq = got = 0
        chunk = self.store.dialect.sql("chunk_get")
        while rows := self.store.query(chunk, (fid, seq)):
            data = bytes(rows[0]["data"])
            got += len(data)
            yield data
            seq += 1
        if got != size:
            raise FileGone(f"the input file {fid!r} was deleted while it was read (after {got} of its {size} bytes)",
                           "input_file_id", "file_deleted", status=409)

    def delete(self, fid: str, owner: str | None = None) -> bool:
        """Delete the file (``owner``: only if it is that owner's); whether there was one to delete."""
        sql = self.store.dialect.sql
        with self.store.transaction() as db:
            row = db.execute(sql("file_owner"), (fid,)).fetchone()
            if row is None or (owner is not None and row["owner"] != owner):
                return False
            db.execute(sql("chunks_delete"), (fid,))
            return db.execute(sql("file_delete"), (fid,)).rowcount > 0


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
            db.execute(self.store.dialect.sql("chunk_insert"), (self.fid, self.seq, data))
        self.seq += 1

    def finish(self, purpose: str, filename: str, owner: str = "") -> dict[str, Any]:
        """The file, whole, recorded under ``owner`` (its uploader's key's)."""
        with self.store.transaction() as db:
            db.execute(self.store.dialect.sql("file_insert"), (self.fid, purpose, filename, self.size, owner))
        return self.store.file(self.fid)  # type: ignore[return-value]

    def abandon(self) -> None:
        with self.store.transaction() as db:
            db.execute(self.store.dialect.sql("chunks_delete"), (self.fid,))


__all__ = ["FileGone", "Files", "TooLarge", "Upload"]
