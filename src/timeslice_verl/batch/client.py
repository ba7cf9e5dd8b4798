"""The batch service's client: what ``timeslice-verl batch submit|status|results|cancel`` do, over its HTTP API (the
OpenAI Batch API's calls; the OpenAI Python client works against the service as well)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from timeslice_verl.batch.status import AGENT_SILENT, ENDED
from timeslice_verl.log import get_logger
from timeslice_verl.names import TenantRole

log = get_logger("batch")




def served_model(tenant_url: str) -> str:
    """The model a tenant serves (its first in ``/v1/models``), which every line of a batch for it names."""
    try:
        data = httpx.get(f"{tenant_url.rstrip('/')}/v1/models", timeout=30).json()["data"]
        return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"the tenant at {tenant_url} does not say which model it serves: {exc}") from None

class BatchClientError(RuntimeError):
    """The service refused a call (its message) or could not be reached."""


class BatchClient:
    def __init__(self, url: str, api_key: str, timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"})

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            resp = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise BatchClientError(f"no batch service answers at {self.url} ({type(exc).__name__}: {exc}); start one with "
                                   "`timeslice-verl batch serve`") from None
        if not resp.is_success:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text[:300]
            raise BatchClientError(f"{method} {path}: HTTP {resp.status_code}: {message}")
        return resp

    def upload(self, path: Path) -> dict[str, Any]:
        with path.open("rb") as f:
            return self._call("POST", "/v1/files", files={"file": (path.name, f, "application/jsonl")},
                              data={"purpose": "batch"}).json()

    def create(self, file_id: str, endpoint: str, metadata: dict[str, str] | None = None, *, priority: int = 0,
               role: TenantRole = TenantRole.batch, window: str = "24h") -> dict[str, Any]:
        body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": window, "metadata": metadata,
                "priority": priority, "tenant_role": role.value}
        return self._call("POST", "/v1/batches", json=body).json()

    def get(self, batch_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/batches/{batch_id}").json()

    def list(self, limit: int = 20) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/batches", params={"limit": limit}).json()["data"]

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/batches/{batch_id}/cancel").json()

    def figures(self, batch_id: str) -> dict[str, Any]:
        """A batch's lines by fate (completed, failed by code, retried, tokens): the service's own endpoint."""
        return self._call("GET", f"/timeslice/batches/{batch_id}").json()

    def summary(self) -> dict[str, Any]:
        return self._call("GET", "/timeslice/summary").json()

    def download(self, file_id: str, out: Path) -> int:
        """Write a file's content to ``out``; the lines written."""
        n = 0
        with self.http.stream("GET", f"/v1/files/{file_id}/content") as resp, out.open("wb") as f:
            if not resp.is_success:
                raise BatchClientError(f"GET /v1/files/{file_id}/content: HTTP {resp.status_code}")
            for chunk in resp.iter_bytes():
                f.write(chunk)
                n += chunk.count(b"\n")
        return n

    def close(self) -> None:
        self.http.close()


def endpoint_of(path: Path) -> str:
    """The endpoint of a JSONL input file (its first request's ``url``)."""
    with path.open("rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    return str(json.loads(raw)["url"])
                except (ValueError, KeyError, TypeError):
                    raise BatchClientError(f"{path}: the first line is not a request with a url") from None
    raise BatchClientError(f"{path}: no request in the file")


def follow(client: BatchClient, batch: dict[str, Any], *, poll_s: float = 1.0, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Show a batch's progress (lines done, rate, ETA) until it ends; its last state. While no line moves, why not
    (once per reason): the service's gate says what its lines wait for."""
    from tqdm import tqdm

    total, said, done = batch["request_counts"]["total"], set(), -1
    with tqdm(total=total, unit="line", desc=batch["id"][:18], dynamic_ncols=True) as bar:
        while True:
            counts = batch["request_counts"]
            now_done = counts["completed"] + counts["failed"]
            bar.n = now_done
            bar.set_postfix(failed=counts["failed"], status=batch["status"], refresh=False)
            bar.refresh()
            if batch["status"] in ENDED:
                return batch
            why = _waiting_for(client) if now_done == done else ""
            if why and why not in said:
                said.add(why)
                with bar.external_write_mode():
                    echo(why)
            done = now_done
            time.sleep(poll_s)
            batch = client.get(batch["id"])


def _waiting_for(client: BatchClient) -> str:
    """What the service's lines wait for, from its gate; "" when they are sent (or the service does not say)."""
    try:
        gate = client.summary().get("gate") or {}
    except (BatchClientError, ValueError):
        return ""
    source, why = str(gate.get("source", "")), str(gate.get("why", ""))
    if gate.get("open") or not why:
        return ""
    if source.startswith("agent") and why == AGENT_SILENT:
        return ("no agent answers on this node: the lines wait until the agent lends the GPU to the tenant; start "
                "`timeslice-verl agent` (or serve with timeslice.batch.follow_agent=false where no trainer shares the GPU)")
    if source == "agent":
        return f"the lines wait while the trainer holds the GPU ({why}); they go to the tenant in its idle valleys"
    return f"the lines wait: {why}"


NOT_SENT = ("batch_cancelled", "batch_expired")
"""Error codes of lines a cancel or the window ended before they were sent: not failures of the tenant."""


def not_sent(client: BatchClient, batch: dict[str, Any]) -> int:
    """Lines of ``batch`` its cancel (or its window) ended before they were sent (0 for a batch never cancelled)."""
    if batch["status"] not in ("cancelling", "cancelled", "expired"):
        return 0
    failed = client.figures(batch["id"]).get("failed") or {}
    return sum(int(failed.get(code, 0)) for code in NOT_SENT)


def describe(batch: dict[str, Any], unsent: int = 0) -> str:
    """One line for a batch; ``unsent``: its lines never sent (cancelled, expired), counted neither done nor failed."""
    c = batch["request_counts"]
    files = "  ".join(f"{k}={batch[k]}" for k in ("output_file_id", "error_file_id") if batch.get(k))
    apart = f", {unsent} not sent ({'expired' if batch['status'] == 'expired' else 'cancelled'})" if unsent else ""
    use, ext = batch.get("usage") or {}, batch.get("timeslice_usage") or {}
    spent = f", {use.get('input_tokens', 0)} tokens in, {use.get('output_tokens', 0)} out, " \
            f"{ext.get('gpu_seconds', 0):.1f} GPU-s" if use else ""
    eta = eta_words(batch.get("timeslice_eta"))
    return (f"{batch['id']}  {batch['status']:11}  {c['completed']}/{c['total']} done, {c['failed']} failed"
            f"{apart}{spent}{'  ' + eta if eta else ''}  {batch['endpoint']}  {files}").rstrip()


def eta_words(field: dict[str, Any] | None) -> str:
    """A batch's ``timeslice_eta`` field (its ETA) in words: "" for an ended batch or a service without the field."""
    if not field or field.get("basis") == "ended":
        return ""
    if field.get("eta_s") is None:
        return "ETA: not measured yet"
    s = float(field["eta_s"])
    when = f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"
    return f"ETA {when}" + (" — LATE: past the end of its completion_window" if field.get("late") else "")


__all__ = ["NOT_SENT", "BatchClient", "BatchClientError", "describe", "endpoint_of", "eta_words", "follow", "not_sent",
           "served_model"]
