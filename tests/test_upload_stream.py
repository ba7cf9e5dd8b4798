"""Uploads and batch creation a chunk at a time: a file is never held whole — split anywhere,
it reads the same; a file refused as a whole late leaves nothing behind; a service killed while it created a
batch fails that batch, saying so, and sends none of its lines."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from timeslice_verl.batch.files import Files, TooLarge
from timeslice_verl.batch.lines import BatchRefused, numbered_lines, parse, parse_stream
from timeslice_verl.batch.store import Store

CHAT = "/v1/chat/completions"


def _line(cid: str, text: str = "hi") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": CHAT,
                       "body": {"model": "m", "messages": [{"role": "user", "content": text}]}}, ensure_ascii=False)


CONTENT = "\n".join([_line("a", "é ü 漢字 🙂"), "", _line("b") + "\r", _line("c", "x" * 300)]).encode()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, len(CONTENT)])
def test_a_file_split_anywhere_reads_the_same_as_whole(size):
    chunks = [CONTENT[i:i + size] for i in range(0, len(CONTENT), size)]  # mid-character, mid-line, mid-\r\n
    assert list(parse_stream(chunks, CHAT)) == parse(CONTENT, CHAT)
    assert [n for n, _ in numbered_lines(chunks)] == [1, 2, 3, 4]


@pytest.mark.parametrize("size", [1, 5, 97, 4096, 1 << 20])
def test_bytes_that_are_not_utf8_are_refused_naming_their_own_line_wherever_the_chunks_are_cut(size):
    """Line 300 of 400 is named line 300 whatever the chunks (a chunk that held many lines named its first)."""
    content = bytearray("".join(_line(f"r{i}", "é") + "\n" for i in range(400)).encode())
    at = content.index('"r299"'.encode())
    content[at + 2] = 0xC3  # the first byte of a two-byte character, then an ASCII one: invalid
    chunks = [bytes(content[i:i + size]) for i in range(0, len(content), size)]
    with pytest.raises(BatchRefused, match=r"^line 300 of the input file: not UTF-8 \(invalid continuation byte "):
        list(parse_stream(chunks, CHAT))


@pytest.mark.parametrize("chunks, message", [
    ([_line("a").encode() + b"\n", b"\xff\xfe\n"], r"line 2 of the input file: not UTF-8 \(invalid start byte at byte 1"),
    ([_line("a").encode() + b"\n", _line("b").encode() + b"\n", _line("a").encode()],
     r"line 3 of the input file: custom_id 'a' is used twice \(lines 1 and 3\)"),
    ([b"\n", b"  \n"], "has no request"),
])
def test_a_file_refused_as_a_whole_is_refused_whatever_came_first(chunks, message):
    with pytest.raises(BatchRefused, match=message):
        list(parse_stream(chunks, CHAT))


def test_a_batch_refused_after_its_first_lines_were_inserted_leaves_nothing(tmp_path, monkeypatch):
    import timeslice_verl.batch.store as store_mod

    monkeypatch.setattr(store_mod, "INSERT_CHUNK", 10)  # the first 30 lines are committed before the refusal
    store = Store(tmp_path / "b.sqlite")
    lines = [_line(f"r{i}") for i in range(40)] + [_line("r3")]
    with pytest.raises(BatchRefused, match="'r3' is used twice \\(lines 4 and 41\\)"):
        store.create_batch(CHAT, "file_x", 86400, "24h", None, parse_stream([("\n".join(lines)).encode()], CHAT))
    assert store.batches() == [] and store.query("SELECT COUNT(*) FROM lines")[0][0] == 0


def test_an_upload_goes_in_chunks_and_one_past_the_bound_leaves_none(tmp_path):
    store = Store(tmp_path / "b.sqlite")
    files = Files(store)
    up = files.writer(max_bytes=100)
    for part in (b"a" * 40, b"b" * 40):
        up.add(part)
    row = up.finish("batch", "in.jsonl")
    assert row["bytes"] == 80 and b"".join(files.chunks(row["id"])) == b"a" * 40 + b"b" * 40
    big = files.writer(max_bytes=100)
    big.add(b"c" * 60)
    with pytest.raises(TooLarge, match="larger than 100 bytes"):
        big.add(b"c" * 60)
    assert store.query("SELECT COUNT(*) FROM file_chunks WHERE file_id = ?", (big.fid,))[0][0] == 0
    half = files.writer(max_bytes=100)
    half.add(b"d" * 10)  # a killed upload: chunks, no row
    assert files.sweep() == 1 and files.chunks(half.fid) is None and files.delete(row["id"])


def test_a_service_killed_while_it_created_a_batch_fails_that_batch_and_sends_none_of_it(tmp_path):
    db = tmp_path / "b.sqlite"
    script = textwrap.dedent(f"""
        import json, os
        import timeslice_verl.batch.store as s
        from timeslice_verl.batch.lines import RequestLine
        s.INSERT_CHUNK = 100
        store = s.Store(s.Path({str(db)!r}))
        def rows():
            for i in range(1000):
                if i == 250:
                    os._exit(9)  # kill -9 with two chunks committed, the batch still validating
                yield RequestLine(i + 1, f"r{{i}}", json.dumps({{"model": "m"}}))
        store.create_batch("/v1/completions", "file_x", 86400, "24h", None, rows())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 9, done.stderr
    store = Store(db)
    [batch] = store.batches()
    assert batch["status"] == "validating" and store.query("SELECT COUNT(*) FROM lines")[0][0] == 200
    store.recover()
    [batch] = store.batches()
    assert batch["status"] == "failed" and json.loads(batch["errors"])["data"][0]["code"] == "interrupted"
    assert store.claim(10) == [] and store.query("SELECT COUNT(*) FROM lines")[0][0] == 0


def test_a_file_of_more_requests_than_a_batch_takes_is_refused_as_it_is_read_and_leaves_nothing(tmp_path, monkeypatch):
    """A 1 000 000-line file, scaled: refused at the first request past the bound, never read whole."""
    import timeslice_verl.batch.lines as lines_mod
    import timeslice_verl.batch.store as store_mod

    monkeypatch.setattr(lines_mod, "MAX_LINES", 100)
    monkeypatch.setattr(store_mod, "INSERT_CHUNK", 16)
    read = []

    def chunks():
        for i in range(10_000):
            read.append(i)
            yield (_line(f"r{i}") + "\n").encode()

    store = Store(tmp_path / "b.sqlite")
    with pytest.raises(BatchRefused, match="more than 100 requests; a batch takes at most 100"):
        store.create_batch(CHAT, "file_x", 86400, "24h", None, parse_stream(chunks(), CHAT))
    assert len(read) == 101, "read up to the first request past the bound, no further"
    assert store.batches() == [] and store.query("SELECT COUNT(*) FROM lines")[0][0] == 0
