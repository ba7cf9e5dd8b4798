"""The OpenAI Batch API's files, as the batch service reads and writes them.

An input file is JSONL, one request a line: ``{"custom_id": …, "method": "POST", "url": "/v1/chat/completions",
"body": {"model": …, …}}``. A line that is not one is failed on its own (it appears in the error file, with its
line number); a file that cannot be a batch at all (not UTF-8, no request, a ``custom_id`` used twice) is refused
with a 400 that names the problem. Output and error lines follow OpenAI's shape: ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_LINES = 50_000
"""Requests in one batch (OpenAI's own bound)."""
MAX_CUSTOM_ID = 512


@dataclass(frozen=True, slots=True)
class LineError:
    """Why one line of an input file fails alone: an OpenAI error object with the line's number."""

    line: int
    message: str
    code: str = "invalid_request"

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": f"line {self.line}: {self.message}", "line": self.line}


@dataclass(frozen=True, slots=True)
class RequestLine:
    """One request line of an input file as the store takes it: its ``custom_id`` (None when the line has none), its
    body as JSON text (None when it fails), or why it fails."""

    number: int
    custom_id: str | None
    body: str | None = None
    error: LineError | None = None


class BatchRefused(ValueError):
    """A request the service refuses as a whole (HTTP 400), naming the parameter."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def _failed(n: int, cid: str | None, message: str, code: str = "invalid_request") -> RequestLine:
    return RequestLine(n, cid, None, LineError(n, message, code))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _text(value: Any) -> str | None:
    """``value`` as JSON text that any server reads (UTF-8, no NaN); None when it cannot be (a lone surrogate)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        text.encode("utf-8")
    except (UnicodeEncodeError, ValueError):
        return None
    return text


def _one(n: int, raw: str, endpoint: str, models: set[str] | None) -> RequestLine:
    try:
        item = json.loads(raw, parse_constant=_no_constant)
    except ValueError as exc:
        return _failed(n, None, f"not JSON ({exc})")
    if not isinstance(item, dict):
        return _failed(n, None, "not a JSON object")
    cid = item.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        return _failed(n, None, f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters")
    if _text(cid) is None:
        return _failed(n, None, "custom_id holds a lone surrogate (\\ud800-\\udfff): not valid Unicode")
    if item.get("method", "POST") != "POST":
        return _failed(n, cid, f"method {item.get('method')!r} is not POST")
    if item.get("url") != endpoint:
        return _failed(n, cid, f"url {item.get('url')!r} is not this batch's endpoint {endpoint!r}")
    body = item.get("body")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return _failed(n, cid, "body must be an object with a model")
    if models is not None and body["model"] not in models:
        served = ", ".join(sorted(models)) or "none"
        return _failed(n, cid, f"model {body['model']!r} is not served by the tenant (served: {served})",
                                      "model_not_found")
    text = _text(body)
    if text is None:
        return _failed(n, cid, "body holds a lone surrogate (\\ud800-\\udfff): not valid Unicode")
    return RequestLine(n, cid, text)


def numbered_lines(chunks: Iterable[bytes]) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a JSONL file given as chunks of bytes (a line may span chunks; lines end at
    ``\n``, a ``\r`` before it dropped): never more than a chunk and a line in memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    buf, n = "", 0
    try:
        for chunk in chunks:
            buf += decoder.decode(chunk)
            *whole, buf = buf.split("\n")
            for raw in whole:
                n += 1
                yield n, raw.removesuffix("\r")
        buf += decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise BatchRefused(f"the input file is not UTF-8 (line {n + 1}: {exc.reason})", "input_file_id") from None
    if buf:
        yield n + 1, buf.removesuffix("\r")


def parse_stream(chunks: Iterable[bytes], endpoint: str, models: set[str] | None = None) -> Iterator[RequestLine]:
    """A :class:`RequestLine` per request line of an input file, as it is read (``models``: what the
    tenant serves, if known). A line whose text no server could read — NaN, a lone surrogate — fails alone, here.
    What refuses the whole file (not UTF-8, no request, too many, a ``custom_id`` twice) raises
    :class:`BatchRefused` — possibly after rows were yielded: the consumer drops what it took."""
    if endpoint not in ENDPOINTS:
        raise BatchRefused(f"endpoint {endpoint!r} is not supported (supported: {', '.join(ENDPOINTS)})", "endpoint")
    seen: dict[str, int] = {}
    twice: list[str] = []
    count = 0
    for n, raw in numbered_lines(chunks):
        if not raw.strip():
            continue
        count += 1
        if count > MAX_LINES:
            raise BatchRefused(f"the input file has more than {MAX_LINES} requests; a batch takes at most {MAX_LINES}",
                               "input_file_id")
        row = _one(n, raw, endpoint, models)
        cid = row.custom_id
        if cid is not None and cid in seen:
            twice.append(f"{cid!r} (lines {seen[cid]} and {n})")
        elif cid is not None:
            seen[cid] = n
        if not twice:
            yield row
    if twice:
        raise BatchRefused(f"custom_id must be unique in a batch: {', '.join(twice[:5])}"
                           + (f" and {len(twice) - 5} more" if len(twice) > 5 else ""), "input_file_id", "duplicate_custom_id")
    if not count:
        raise BatchRefused("the input file has no request", "input_file_id")


def parse(content: bytes, endpoint: str, models: set[str] | None = None) -> list[RequestLine]:
    """:func:`parse_stream` of a whole file in memory."""
    return list(parse_stream([content], endpoint, models))


def _request_id(batch_id: str, idx: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{idx}"


LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})
"""Characters JSON leaves raw inside a string (vLLM's answers carry them as they are) that Python's ``splitlines``
and JavaScript's older parsers take for line ends: written escaped, the same JSON, one line for every reader (a
512-token answer of the test model on an H200 broke a reader that split the output file that way)."""


def output_lines(batch_id: str, rows: Iterable[Any]) -> Iterator[bytes]:
    """The output file: one line per request that was answered (the stored response is JSON text, written as is but
    for :data:`LINE_BREAKS`)."""
    for r in rows:
        yield (f'{{"id": {json.dumps(_request_id(batch_id, r["idx"]))}, "custom_id": {json.dumps(r["custom_id"])}, '
               f'"response": {r["response"].translate(LINE_BREAKS)}, "error": null}}\n').encode()


def error_lines(batch_id: str, rows: Iterable[Any]) -> Iterator[bytes]:
    """The error file: one line per request that failed (for good), with why."""
    for r in rows:
        response = (r["response"] or "null").translate(LINE_BREAKS)
        yield (f'{{"id": {json.dumps(_request_id(batch_id, r["idx"]))}, "custom_id": {json.dumps(r["custom_id"])}, '
               f'"response": {response}, "error": {r["error"].translate(LINE_BREAKS)}}}\n').encode()


__all__ = ["ENDPOINTS", "MAX_LINES", "BatchRefused", "LineError", "RequestLine", "error_lines", "numbered_lines", "output_lines", "parse",
           "parse_stream"]
