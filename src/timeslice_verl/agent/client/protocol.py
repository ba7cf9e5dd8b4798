"""The agent's wire protocol: newline-delimited JSON over a Unix socket, versioned and validated.

Request:  ``{"v": 1, "id": 7, "op": "acquire", "job": "grpo-a", "timeout_s": 600}``
Response: ``{"v": 1, "id": 7, "ok": true, "result": {...}}`` or
          ``{"v": 1, "id": 7, "ok": false, "error": {"code": "bad_request", "message": "..."}}``

One request per line, at most :data:`MAX_REQUEST_BYTES`. A connection may have several requests in
flight (responses carry the request ``id``). Every field of every operation is checked here, before
the agent acts, and a bad one is answered with an error that names it; the connection stays usable
(except after an over-long line, which cannot be resynchronised).
"""

from __future__ import annotations

import json
import math
import socket
import struct
import urllib.parse
from dataclasses import dataclass
from typing import Any

from timeslice_verl.names import SWAP_MODES, SwapMode, repeated_url, valid_job, valid_url

PROTOCOL_VERSION = 1
MAX_REQUEST_BYTES = 64 * 1024
MAX_SECONDS = 30 * 86400.0
"""The longest timeout or TTL a request may ask for."""
MAX_PIDS = 4096
MAX_URLS = 64
"""Servers in one tenant: one vLLM per GPU of the node."""
MAX_BYTES = 2**50


def peer_credentials(sock: socket.socket | None) -> tuple[int | None, int | None]:
    """``(pid, uid)`` of the process at the other end of a Unix socket; ``(None, None)`` when the
    kernel does not say (the caller then refuses the connection: fail closed)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))  # type: ignore[union-attr]
        pid, uid, _gid = struct.unpack("3i", raw)
        return pid, uid
    except (OSError, AttributeError, struct.error):
        return None, None


class ErrorCode:
    BAD_JSON = "bad_json"
    BAD_REQUEST = "bad_request"
    TOO_LARGE = "too_large"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_OP = "unknown_op"
    TIMEOUT = "timeout"
    BUSY = "busy"
    FAULT = "fault"
    PERMISSION = "permission"
    SHUTTING_DOWN = "shutting_down"
    TENANT = "tenant"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A request the agent refuses; ``code`` is one of :class:`ErrorCode`."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


@dataclass(frozen=True)
class Field:
    kind: str  # job | number | bool | pids | urls | level | str | swap | parked | supervisor
    required: bool = False


OPS: dict[str, dict[str, Field]] = {
    "hello": {"client": Field("str")},
    "acquire": {"job": Field("job", True), "timeout_s": Field("number"), "pids": Field("pids")},
    "release": {"job": Field("job", True), "wait": Field("bool"), "done": Field("bool"), "swap": Field("swap"),
                "parked": Field("parked")},
    "prepare": {"job": Field("job", True), "ttl_s": Field("number")},
    "register_pids": {"job": Field("job", True), "pids": Field("pids", True)},
    "attach": {"job": Field("job", True), "holding": Field("bool")},
    "status": {},
    "register_tenant": {"urls": Field("urls", True), "sleep_level": Field("level"), "supervisor": Field("supervisor")},
    "unregister_tenant": {},
    "watch_owner": {"seen": Field("str"), "timeout_s": Field("number")},
}


def _check(name: str, field: Field, value: Any) -> Any:
    kind = field.kind
    if kind == "job":
        if not isinstance(value, str) or not valid_job(value):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"field {name!r}: {value!r} is not a job name (letters, digits, '.', '_', '-'; max 64)"
            )
    elif kind == "number":
        try:
            number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
        except OverflowError:
            number = math.inf
        if not math.isfinite(number) or not 0 <= number <= MAX_SECONDS:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r}: expected a number of seconds in [0, {MAX_SECONDS:g}], "
                                f"got {str(value)[:40]!r}")
        value = number
    elif kind == "bool":
        if not isinstance(value, bool):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r}: expected true or false, got {value!r}")
    elif kind == "pids":
        if (
            not isinstance(value, list)
            or len(value) > MAX_PIDS
            or not all(isinstance(p, int) and not isinstance(p, bool) and 1 < p < 2**31 for p in value)
        ):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r}: expected a list of process ids, got {value!r:.200}")
    elif kind == "urls":
        if not isinstance(value, list) or not 1 <= len(value) <= MAX_URLS:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r}: expected a list of 1 to {MAX_URLS} http(s) URLs "
                                f"(one vLLM per GPU), got {value!r:.200}")
        for i, u in enumerate(value):
            if not valid_url(u) or not url_parts_ok(u):
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r}[{i}]: {u!r:.200} is not an http(s) URL")
        if repeated_url(value):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r}: {repeated_url(value)!r:.200} is listed twice")
    elif kind == "level":
        if value not in (1, 2) or isinstance(value, bool):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r}: vLLM sleep level must be 1 or 2, got {value!r}")
    elif kind == "swap":
        if value not in SWAP_MODES:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r}: {value!r:.60} is not one of {', '.join(SWAP_MODES)}")
        value = SwapMode(value)
    elif kind == "parked":
        value = _parked(name, value)
    elif kind == "supervisor":
        value = _supervisor(name, value)
    elif kind == "str":
        if not isinstance(value, str) or len(value) > 200:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r}: expected a short string")
    return value


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_BYTES


def _parked(name: str, value: Any) -> list[dict[str, int]]:
    """``[{"pid": 123, "parked": bytes, "kept": bytes}, ...]``: what each worker parked and still holds."""
    if not isinstance(value, list) or len(value) > MAX_PIDS:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r}: expected a list of park reports, got {value!r:.200}")
    out = []
    for item in value:
        if (
            not isinstance(item, dict) or set(item) != {"pid", "parked", "kept"}
            or not (_count(item["pid"]) and 1 < item["pid"] < 2**31) or not _count(item["parked"]) or not _count(item["kept"])
        ):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r}: each report is {{\"pid\": int, \"parked\": bytes, "
                                f"\"kept\": bytes}}, got {item!r:.200}")
        out.append({"pid": item["pid"], "parked": item["parked"], "kept": item["kept"]})
    return out


SUPERVISOR_FIELDS = {"pid": "count", "restarts": "count", "last_exit": "str", "started": "number", "start_s": "number",
                     "restart_s": "number"}


def _supervisor(name: str, value: Any) -> dict[str, Any]:
    """What a tenant supervisor says of the server it (re)started: its pid, restarts, last exit, when it registered
    it, how long it took to answer (``start_s``) and the last restart (``restart_s``: from its exit to its return)."""
    if not isinstance(value, dict) or not set(value) <= set(SUPERVISOR_FIELDS):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r}: expected an object with some of "
                            f"{', '.join(SUPERVISOR_FIELDS)}, got {value!r:.200}")
    for key, kind in SUPERVISOR_FIELDS.items():
        item = value.get(key)
        if item is None:
            continue
        ok = (_count(item) and item < 2**31 if kind == "count" else
              isinstance(item, str) and len(item) <= 300 and item.isprintable() if kind == "str" else
              isinstance(item, (int, float)) and not isinstance(item, bool) and math.isfinite(item))
        if not ok:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r}: {key} is not a valid {kind}: {item!r:.100}")
    return dict(value)


def url_parts_ok(url: str) -> bool:
    """Host and port parse, no control character or space anywhere (what an HTTP client would reject)."""
    if any(ord(ch) < 0x21 or ord(ch) == 0x7F for ch in url):
        return False
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError for a bad port)
    except ValueError:
        return False
    return bool(parts.hostname) and parts.hostname.isascii()


def parse_request(line: bytes) -> tuple[Any, str, dict[str, Any]]:
    """Decode and validate one request line: ``(id, op, args)``. Raises :class:`ProtocolError`."""
    if len(line) > MAX_REQUEST_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"request is {len(line)} bytes; the limit is {MAX_REQUEST_BYTES}")
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, integers past 4300 digits, deep nesting
        raise ProtocolError(ErrorCode.BAD_JSON, f"not a JSON object: {str(exc)[:200]}") from None
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.BAD_JSON, f"expected a JSON object, got {type(msg).__name__}")
    req_id = msg.get("id")
    if req_id is not None and (isinstance(req_id, bool) or not isinstance(req_id, (int, str))):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "field 'id': expected an integer or a string")
    version = msg.get("v")
    if isinstance(version, bool) or version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION, f"protocol version {version!r} is not supported; this agent speaks v{PROTOCOL_VERSION}"
        )
    op = msg.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r}; known: {', '.join(sorted(OPS))}")
    spec = OPS[op]
    unknown = set(msg) - set(spec) - {"v", "id", "op"}
    if unknown:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"op {op!r} takes no field(s) {', '.join(sorted(unknown))}")
    args: dict[str, Any] = {}
    for name, field in spec.items():
        if name not in msg:
            if field.required:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"op {op!r} needs field {name!r}")
            continue
        args[name] = _check(name, field, msg[name])
    return req_id, op, args


def request_id_of(line: bytes) -> Any:
    """Best-effort ``id`` of a line that failed validation, so the error can be matched."""
    try:
        msg = json.loads(line)
        req_id = msg.get("id") if isinstance(msg, dict) else None
        return req_id if isinstance(req_id, (int, str)) and not isinstance(req_id, bool) else None
    except Exception:
        return None


def encode(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, separators=(",", ":"), default=str) + "\n").encode()


def ok(req_id: Any, result: dict[str, Any]) -> bytes:
    return encode({"v": PROTOCOL_VERSION, "id": req_id, "ok": True, "result": result})


def error(req_id: Any, code: str, message: str) -> bytes:
    return encode({"v": PROTOCOL_VERSION, "id": req_id, "ok": False, "error": {"code": code, "message": message}})
