"""The Batch API's request bodies as typed models: FastAPI validates them, and every refusal — a model's
validator, a missing field, a body that is not JSON — becomes one OpenAI-shaped 400 naming the parameter
(``app.py``'s handler of :class:`fastapi.exceptions.RequestValidationError`)."""

from __future__ import annotations

from typing import Dict, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from timeslice_verl.batch.lines import ENDPOINTS
from timeslice_verl.names import TenantRole

WINDOWS = ("24h",)
"""The completion windows OpenAI's Batch API takes."""


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
        if value not in WINDOWS:
            raise ValueError(f"completion_window {value!r} is not supported: use '24h'")
        return value

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, value: object) -> object:
        problem = metadata_problem(value)
        if problem:
            raise ValueError(problem)
        return value


__all__ = ["CreateBatch", "WINDOWS", "metadata_problem"]
