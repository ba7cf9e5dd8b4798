"""A batch's status, as OpenAI's Batch API names it: one enum for the store, the API, the client and the CLI."""

from __future__ import annotations

import enum


class BatchStatus(str, enum.Enum):
    validating = "validating"
    in_progress = "in_progress"
    finalizing = "finalizing"
    cancelling = "cancelling"
    completed = "completed"
    failed = "failed"
    expired = "expired"
    cancelled = "cancelled"

    def __str__(self) -> str:
        return self.value

    @property
    def ended(self) -> bool:
        return self.value in ENDED


OPEN = ("validating", "in_progress", "finalizing", "cancelling")
"""Statuses of a batch that may still change."""
ENDED = ("completed", "failed", "expired", "cancelled")
"""Statuses of a batch that never change again (its output and error files are whole)."""

AGENT_SILENT = "the agent does not answer"
"""Why the service's gate holds its lines when the node's agent does not answer (its summary's ``gate.why``)."""

__all__ = ["AGENT_SILENT", "BatchStatus", "ENDED", "OPEN"]
