"""The Batch API's request bodies as typed models: FastAPI validates them, and every refusal — a model's
validator, a missing field, a body that is not JSON — becomes one OpenAI-shaped 400 naming the parameter
(``app.py``'s handler of :class:`fastapi.exceptions.RequestValidationError`)."""

from __future__ import annotations

import re
from typing import Dict, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from timeslice_verl.batch.lines import ENDPOINTS
from timeslice_verl.names import TenantRole

WINDOWS = ("24h",)
"""The completion windows OpenAI's Batch API takes; this service takes shorter ones too (:func:`window_seconds`)."""
MIN_WINDOW_S, MAX_WINDOW_S = 300, 86400
"""The shortest and longest completion window (5 minutes, OpenAI's 24 hours)."""
_WINDOW = re.compile(r"([1-9][0-9]{0,4})([hm])")


def window_seconds(text: str) -> int:
    """A ``completion_window`` in seconds: ``<N>h`` or ``<N>m`` (OpenAI's ``24h``, or shorter: ``1h``, ``90m``),
    from :data:`MIN_WINDOW_S` to :data:`MAX_WINDOW_S`; ValueError saying what is taken otherwise."""
    found = _WINDOW.fullmatch(text) if isinstance(text, str) else None
    seconds = int(found[1]) * (3600 if found[2] == "h" else 60) if found else 0
    if not MIN_WINDOW_S <= seconds <= MAX_WINDOW_S:
        raise ValueError(f"completion_window {text!r} is not supported: use '24h' (OpenAI's) or a shorter window of "
                         f"whole hours or minutes ('1h', '4h', '90m'), from {MIN_WINDOW_S // 60}m to "
                         f"{MAX_WINDOW_S // 3600}h")
    return seconds


def metadata_problem(metadata: object) -> str:
    """What is wrong with a batch's metadata by OpenAI's rules (16 string pairs, keys ≤ 64, values ≤ 512), or ""."""
    if metadata is None:
        return ""
    if not isinstance(metadata, dict):
        return "metadata must be an object of strings"
    if len(metadata) > 16:
        return f"metadata has {len(metadata)} keys; at most 16"
    for key, value in metadata.items():
        if len(key) > 64:
            return f"metadata key {key[:20]!r}… is longer than 64 characters"
        if not isinstance(value, str) or len(value) > 512:
            return f"metadata[{key!r}] must be a string of at most 512 characters"
    return ""


class CreateBatch(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Optional[Dict[str, str]] = None
    priority: int = Field(0, ge=-100, le=100)
    """Ours, not OpenAI's (the OpenAI client sends it with ``extra_body``): a batch of a higher priority is sent first
    (validation above users' work); equal priorities share the tenant between API keys."""
    tenant_role: TenantRole = TenantRole.batch
    """Ours: which tenants answer it — ``policy``: a validation run, sent to the policy tenant alone."""

    @field_validator("input_file_id")
    @classmethod
    def _file_id(cls, value: str) -> str:
        if "\x00" in value:  # never an id; PostgreSQL's text takes no NUL
            raise ValueError("input_file_id holds a NUL character (\\u0000)")
        return value

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str) -> str:
        if value not in ENDPOINTS:
            raise ValueError(f"endpoint {value!r} is not supported (supported: {', '.join(ENDPOINTS)})")
        return value

    @field_validator("completion_window")
    @classmethod
    def _window(cls, value: str) -> str:
        window_seconds(value)
        return value

    @property
    def window_s(self) -> int:
        """The window in seconds: the batch expires that long after its creation."""
        return window_seconds(self.completion_window)

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, value: object) -> object:
        problem = metadata_problem(value)
        if problem:
            raise ValueError(problem)
        return value


__all__ = ["CreateBatch", "MAX_WINDOW_S", "MIN_WINDOW_S", "WINDOWS", "metadata_problem", "window_seconds"]
