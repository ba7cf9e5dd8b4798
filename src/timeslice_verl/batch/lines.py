"""The OpenAI Batch API's files, as the batch service reads and writes them.

An input file is JSONL, one request a line: ``{"custom_id": …, "method": "POST", "url": "/v1/chat/completions",
"body": {"model": …, …}}``. The whole file is checked before a batch exists, as OpenAI's API checks it: a line that
is not such a request (not JSON, a field missing or wrong, a model the tenant does not serve, a ``custom_id`` used
twice, bytes that are not UTF-8), too many requests or none refuse the file with a 400 that names the first bad
line and why. Output and error lines follow OpenAI's shape: ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_LINES = 50_000
"""Requests in one batch (OpenAI's own bound)."""
MAX_CUSTOM_ID = 512


@dataclass(frozen=True, slots=True)
class RequestLine:
    """One request line of an input file as the store takes it: its number, its ``custom_id``, its body as JSON
    text and the tokens it asks for at most (:func:`asked_tokens`)."""

    number: int
    custom_id: str
    body: str
    asked: int | None = None


LIMITS = {"/v1/chat/completions": ("max_completion_tokens", "max_tokens"), "/v1/completions": ("max_tokens",)}
"""The body's fields that bound an answer's tokens, per endpoint, the first given counting (OpenAI's chat API took
``max_tokens`` before ``max_completion_tokens``)."""


def asked_tokens(body: dict[str, Any], endpoint: str) -> int | None:
    """The completion tokens a request asks for at most — its limit times its ``n`` choices — or None when it names
    no limit (the model's own then): what the ETA takes for a batch's work before its own answers say better."""
    limit = next((body[k] for k in LIMITS.get(endpoint, ()) if body.get(k) is not None), None)
    n = 1 if body.get("n") is None else body["n"]
    if not _count(limit) or not _count(n):
        return None
    return int(limit) * int(n)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class BatchRefused(ValueError):
    """A request the service refuses as a whole (HTTP ``status``, 400 unless said), naming the parameter; ``line``:
    the input file's line at fault, if one is."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request", *, status: int = 400,
                 line: int | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.line = message, param, code, status, line


def _bad(n: int, message: str, code: str = "invalid_request") -> BatchRefused:
    return BatchRefused(f"line {n} of the input file: {message}", "input_file_id", code, line=n)


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


def _custom_id(n: int, item: dict[str, Any]) -> str:
    """The line's ``custom_id``, stored as it is in a text column: PostgreSQL's take no NUL, no lone surrogate."""
    cid = item.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > MAX_CUSTOM_ID:
        raise _bad(n, f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters")
    if "\x00" in cid:
        raise _bad(n, "custom_id holds a NUL character (\\u0000)")
    if _text(cid) is None:
        raise _bad(n, "custom_id holds a lone surrogate (\\ud800-\\udfff): not valid Unicode")
    return cid


def _one(n: int, raw: str, endpoint: str, models: set[str] | None) -> RequestLine:
    """The request of line ``n``, or :class:`BatchRefused` naming the line and what is wrong with it."""
    try:
        item = json.loads(raw, parse_constant=_no_constant)
    except ValueError as exc:
        raise _bad(n, f"not JSON ({exc})") from None
    if not isinstance(item, dict):
        raise _bad(n, "not a JSON object")
    cid = _custom_id(n, item)
    if "method" not in item or item["method"] != "POST":
        raise _bad(n, f"method {item['method']!r} is not POST" if "method" in item else "method is missing (POST)")
    if "url" not in item:
        raise _bad(n, f"url is missing (this batch's endpoint {endpoint!r})")
    if item["url"] != endpoint:
        raise _bad(n, f"url {item['url']!r} is not this batch's endpoint {endpoint!r}")
    body = item.get("body")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        raise _bad(n, "body must be an object with a model")
    if models is not None and body["model"] not in models:
        served = ", ".join(sorted(models)) or "none"
        raise _bad(n, f"model {body['model']!r} is not served by the tenant (served: {served})", "model_not_found")
    text = _text(body)  # JSON text escapes every control character: a NUL in the body is stored as \u0000
    if text is None:
        raise _bad(n, "body holds a lone surrogate (\\ud800-\\udfff): not valid Unicode")
    return RequestLine(n, cid, text, asked_tokens(body, endpoint))


def numbered_lines(chunks: Iterable[bytes]) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a JSONL file given as chunks of bytes (a line may span chunks; lines end at
    ``\n``, a ``\r`` before it dropped): never more than a chunk and a line in memory. Lines are split as bytes (no
    byte of a UTF-8 character is ``\n``) and each decoded alone, so bytes that are not UTF-8 are refused naming their
    own line, wherever the chunks were cut."""
    buf, n = b"", 0
    for chunk in chunks:
        buf += chunk
        *whole, buf = buf.split(b"\n")
        for raw in whole:
            n += 1
            yield n, _decode(n, raw).removesuffix("\r")
    if buf:
        yield n + 1, _decode(n + 1, buf).removesuffix("\r")


def _decode(n: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(n, f"not UTF-8 ({exc.reason} at byte {exc.start + 1} of the line)") from None


def parse_stream(chunks: Iterable[bytes], endpoint: str, models: set[str] | None = None) -> Iterator[RequestLine]:
    """A :class:`RequestLine` per request line of an input file, as it is read (``models``: what the tenant serves,
    if known). The first line that cannot be a request — or a file of too many requests, or of none — raises
    :class:`BatchRefused`, possibly after rows were yielded: the consumer drops what it took."""
    if endpoint not in ENDPOINTS:
        raise BatchRefused(f"endpoint {endpoint!r} is not supported (supported: {', '.join(ENDPOINTS)})", "endpoint")
    seen: dict[str, int] = {}
    for n, raw in numbered_lines(chunks):
        if not raw.strip():
            continue
        if len(seen) >= MAX_LINES:
            raise BatchRefused(f"the input file has more than {MAX_LINES} requests; a batch takes at most {MAX_LINES}",
                               "input_file_id", line=n)
        row = _one(n, raw, endpoint, models)
        if row.custom_id in seen:
            raise _bad(n, f"custom_id {row.custom_id!r} is used twice (lines {seen[row.custom_id]} and {n}): it must be "
                          "unique in a batch", "duplicate_custom_id")
        seen[row.custom_id] = n
        yield row
    if not seen:
        raise BatchRefused("the input file has no request", "input_file_id")


def parse(content: bytes, endpoint: str, models: set[str] | None = None) -> list[RequestLine]:
    """:func:`parse_stream` of a whole file in memory."""
    return list(parse_stream([content], endpoint, models))


def _request_id(batch_id: str, idx: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{idx}"


LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})
"""Characters JSON leaves raw inside a string (vLLM's answers carry them as they are) that Python's ``splitlines``
and JavaScript's older parsers take for line ends: written escaped, the same JSON, one line for every reader (a
real answer carrying one broke a reader that split the output file that way)."""


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


__all__ = ["ENDPOINTS", "LIMITS", "MAX_LINES", "BatchRefused", "RequestLine", "asked_tokens", "error_lines", "numbered_lines",
           "output_lines", "parse", "parse_stream"]
