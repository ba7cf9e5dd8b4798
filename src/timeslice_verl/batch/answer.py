"""What one answer of the tenant means for its line: done, again (not the request's fault) or failed, and why."""

from __future__ import annotations

import json
from typing import Any, Literal

Fate = Literal["done", "again", "failed"]
ABORTED = "aborted by the tenant (the reclaim ladder's abort step)"
"""Why a line whose answer ended ``finish_reason: "abort"`` goes again (what it generated may be kept:
:mod:`timeslice_verl.batch.resume`)."""


def classify(status: int, body: Any) -> tuple[Fate, str]:
    """What an answer means for its line: ``done``, ``again`` (not the request's fault) or ``failed``; and why."""
    if 200 <= status < 300:
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or not choices:
            return "again", "an answer without choices"
        if any(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices):
            return "again", ABORTED
        return "done", ""
    if status >= 500 or status in (408, 429):
        return "again", f"HTTP {status}"
    return "failed", f"HTTP {status}"


def parsed(raw: bytes) -> tuple[Any, str]:
    """An answer's body and its JSON text (one that is not JSON: its first 2000 characters, as a JSON object)."""
    text = raw.decode("utf-8", "replace")
    try:
        return json.loads(text), text
    except ValueError:
        return {"text": text[:2000]}, json.dumps({"text": text[:2000]})


def refused(status: int, body: Any, text: str, why: str) -> str:
    """The error (JSON text) of a line the tenant refused (a 4xx: the request's own fault), with vLLM's message."""
    message = (body.get("message") or (body.get("error") or {}).get("message")) if isinstance(body, dict) else ""
    return json.dumps({"code": "model_not_found" if status == 404 else "request_failed",
                       "message": f"{why}: {message or text[:300]}"})


__all__ = ["ABORTED", "Fate", "classify", "parsed", "refused"]
