"""The batch service's HTTP API: the OpenAI Batch API's subset (files and batches), a summary and the metrics.

``POST /v1/files`` (multipart, purpose ``batch``), ``GET /v1/files[/{id}[/content]]``, ``DELETE /v1/files/{id}``;
``POST /v1/batches``, ``GET /v1/batches[/{id}]``, ``POST /v1/batches/{id}/cancel``. A batch's output and error files
are made from its lines when downloaded (``file-out-<batch>``, ``file-err-<batch>``). Errors answer in OpenAI's
shape: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx that names the problem.

Each file and batch is its owner's (the owner the caller's key names, :mod:`~timeslice_verl.batch.auth`): another
owner's id answers exactly as a missing one, the lists hold the caller's alone, an ``admin`` key reaches all. An
owner over a token quota (:mod:`~timeslice_verl.batch.quota`) gets 429 with ``Retry-After`` for a new batch.

A batch object's ``usage`` holds its tokens as OpenAI's does; the extension field ``timeslice_usage`` what it used of
the valleys (:mod:`~timeslice_verl.batch.usage`).
A batch object carries its ETA in the extension field ``timeslice_eta`` (:mod:`~timeslice_verl.batch.estimates`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from timeslice_verl.batch.bodies import CreateBatch
from timeslice_verl.batch.estimates import ETA_FIELD, Estimates
from timeslice_verl.batch.eta import Rate
from timeslice_verl.batch.files import Files, TooLarge
from timeslice_verl.batch.keys import ALL_PRIORITIES, ApiKey, KeyRole
from timeslice_verl.batch.lines import BatchRefused, error_lines, output_lines, parse_stream
from timeslice_verl.batch.store import OPEN, Store, StoreUnavailable
from timeslice_verl.batch.usage import FIELD, extension, usage_object
from timeslice_verl.names import TenantRole

OUT, ERR = "file-out-", "file-err-"
UNGUARDED = ApiKey("", "", KeyRole.admin, ALL_PRIORITIES)
"""The caller of an app served without :class:`~timeslice_verl.batch.auth.RequireKey` (tests, a tool in process):
every owner's objects, every priority — but ``/health`` tells why it is unhealthy only to a request with a key."""


def caller(request: Request) -> ApiKey:
    """The key of the request (set by :class:`~timeslice_verl.batch.auth.RequireKey`)."""
    return getattr(request.state, "key", UNGUARDED)


def owned(row: dict[str, Any] | None, key: ApiKey) -> dict[str, Any] | None:
    """The row if ``key`` reaches it; None for another owner's as for a missing one."""
    return row if row is not None and key.reaches(row["owner"]) else None


def refuse(status: int, message: str, param: str | None = None, code: str = "invalid_request") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}},
                        status_code=status)


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed"}


def batch_object(store: Store, row: dict[str, Any], eta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The batch as OpenAI shows it: its lines never sent (cancelled, expired) are in its error file, and in its total
    only — neither completed nor failed; ``eta``: its ``timeslice_eta`` field, if given."""
    counts = store.counts(row["id"])
    ended = row["status"] not in OPEN
    out = {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
           "errors": json.loads(row["errors"]) if row.get("errors") else None,
           "input_file_id": row["input_file_id"], "completion_window": row["completion_window"], "status": row["status"],
           "output_file_id": f"{OUT}{row['id']}" if ended and counts["completed"] else None,
           "error_file_id": f"{ERR}{row['id']}" if ended and row["total"] > counts["completed"] else None,
           "request_counts": {"total": row["total"], "completed": counts["completed"], "failed": counts["failed"]},
           "metadata": json.loads(row["metadata"]) if row["metadata"] else None}
    for key in ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
                "cancelling_at", "cancelled_at"):
        out[key] = row[key]
    out["usage"], out[FIELD] = usage_object(row), extension(row)
    if eta is not None:
        out[ETA_FIELD] = eta
    return out


def make_app(store: Store, *, models: Callable[[TenantRole], set[str] | None], kick: Callable[[], None], summary: Callable[[], dict],
             metrics: Callable[[], bytes], max_file_bytes: int, problem: Callable[[], str] = lambda: "",
             chunk_bytes: int = 4 << 20, api: bool = True, rate: Callable[[], Rate | None] = lambda: None) -> FastAPI:
    """The service's app over ``store`` (``models``: what the tenant serves, if known; ``kick``: new lines to send;
    ``problem``: why the service cannot do its work now, if it cannot; ``chunk_bytes``: the most of a file held at
    once; ``api``: the OpenAI Batch API too, else only health, figures and metrics — a feeder of a cluster; ``rate``:
    the speed the service measured, for the ETAs — None while it has none)."""
    app = FastAPI(title="timeslice-verl batch", version="1")
    if api:
        files = Files(store)
        _files(app, store, files, max_file_bytes, chunk_bytes)
        etas = Estimates(store, rate, lambda owner: store.queue.quotas.policy_of(owner).weight)
        _batches(app, store, files, models, kick, etas)

    @app.middleware("http")
    async def no_nul(request: Request, call_next: Callable[[Request], Any]) -> Any:
        """A NUL in the path or query (``%00``) is in no id, and PostgreSQL's text cannot even hold it: refused here."""
        query = (part for pair in request.query_params.multi_items() for part in pair)
        if "\x00" in request.scope["path"] or any("\x00" in part for part in query):
            return refuse(400, "the request's path or query holds a NUL character (%00), which no id or value has")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = (exc.errors() or [{}])[0]
        if first.get("type") == "json_invalid":
            return refuse(400, f"the request body is not JSON ({first.get('ctx', {}).get('error', 'invalid')})")
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = str(first.get("msg", "is not valid")).removeprefix("Value error, ")
        return refuse(400, msg if where and msg.startswith(where) else f"{where or 'the request body'}: {msg}", where)

    @app.exception_handler(StoreUnavailable)
    async def storage(request: Request, exc: StoreUnavailable) -> JSONResponse:
        return refuse(503, f"the batch service's database {store.path} cannot be written: {exc}", None,
                      "storage_unavailable")

    @app.get("/health")
    def health(request: Request) -> Any:
        why = problem()
        if why and not hasattr(request.state, "key"):  # an anonymous probe: that it is unhealthy, not where or why
            why = "the batch service cannot do its work now (send the API key to learn why)"
        return refuse(503, why, None, "unhealthy") if why else {"status": "ok"}

    @app.get("/timeslice/summary")
    def get_summary(request: Request) -> dict[str, Any]:
        out, key = summary(), caller(request)
        if not key.admin and "open_batches" in out:  # the service's figures; of the batches and owners, the caller's
            out = {**out, "open_batches": [b for b in out["open_batches"] if owned(store.batch(b["id"]), key)],
                   "owners": [o for o in out.get("owners", []) if o["owner"] == key.owner]}
        return out

    @app.get("/timeslice/batches/{bid}")
    def get_figures(bid: str, request: Request) -> Any:
        row = owned(store.batch(bid), caller(request))
        if row is None:
            return refuse(404, f"no batch {bid!r}", "batch_id", "not_found")
        quotas = store.queue.quotas
        over = quotas.over(row["owner"], quotas.policy_of(row["owner"])) if row["status"] in OPEN else None
        return {"id": bid, **store.figures(bid), "paused": str(over) if over else None}

    @app.get("/metrics")
    def get_metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics().decode(), media_type="text/plain; version=0.0.4")

    return app


def _files(app: FastAPI, store: Store, files: Files, max_file_bytes: int, chunk_bytes: int) -> None:
    @app.post("/v1/files")
    async def upload(request: Request, file: UploadFile = File(...), purpose: str = Form(...)) -> Any:
        if purpose != "batch":
            return refuse(400, f"purpose {purpose!r} is not supported: this service takes 'batch' files", "purpose")
        up = files.writer(max_file_bytes)
        try:
            while data := await file.read(chunk_bytes):  # the multipart parser spooled it to disk: a chunk at a time
                await asyncio.to_thread(up.add, data)
        except TooLarge as exc:
            return refuse(413, str(exc), "file", "file_too_large")
        except BaseException:
            await asyncio.to_thread(up.abandon)
            raise
        made = await asyncio.to_thread(up.finish, purpose, file.filename or "input.jsonl", caller(request).owner)
        return file_object(made)

    @app.get("/v1/files")
    def list_files(request: Request) -> dict[str, Any]:
        key = caller(request)
        return {"object": "list", "data": [file_object(r) for r in store.files(None if key.admin else key.owner)]}

    @app.get("/v1/files/{fid}")
    def get_file(fid: str, request: Request) -> Any:
        key = caller(request)
        row = owned(store.file(fid), key) or _result_file(store, fid, key)
        return file_object(row) if row else refuse(404, f"no file {fid!r}", "file_id", "not_found")

    @app.get("/v1/files/{fid}/content")
    def content(fid: str, request: Request) -> Any:
        key = caller(request)
        if fid.startswith((OUT, ERR)):
            bid = fid[len(OUT):] if fid.startswith(OUT) else fid[len(ERR):]
            if owned(store.batch(bid), key) is None:
                return refuse(404, f"no file {fid!r}", "file_id", "not_found")
            rows = store.results(bid, "done" if fid.startswith(OUT) else "failed")
            return StreamingResponse(output_lines(bid, rows) if fid.startswith(OUT) else error_lines(bid, rows),
                                     media_type="application/jsonl")
        chunks = files.chunks(fid) if owned(store.file(fid), key) else None
        return refuse(404, f"no file {fid!r}", "file_id", "not_found") if chunks is None else \
            StreamingResponse(chunks, media_type="application/jsonl")

    @app.delete("/v1/files/{fid}")
    def delete(fid: str, request: Request) -> Any:
        key = caller(request)
        if not files.delete(fid, None if key.admin else key.owner):
            return refuse(404, f"no file {fid!r}", "file_id", "not_found")
        return {"id": fid, "object": "file", "deleted": True}


def _result_file(store: Store, fid: str, key: ApiKey) -> dict[str, Any] | None:
    """The virtual file object of a batch's output or error file, if ``key`` reaches the batch."""
    if not fid.startswith((OUT, ERR)):
        return None
    bid = fid[len(OUT):] if fid.startswith(OUT) else fid[len(ERR):]
    row = owned(store.batch(bid), key)
    if row is None:
        return None
    lines = output_lines(bid, store.results(bid, "done")) if fid.startswith(OUT) else \
        error_lines(bid, store.results(bid, "failed"))
    name = "output" if fid.startswith(OUT) else "errors"
    return {"id": fid, "purpose": "batch_output", "filename": f"{bid}_{name}.jsonl", "bytes": sum(len(x) for x in lines),
            "created_at": row["completed_at"] or row["created_at"]}


def _batches(app: FastAPI, store: Store, files: Files, models: Callable[[TenantRole], set[str] | None],
             kick: Callable[[], None], etas: Estimates) -> None:
    @app.post("/v1/batches")
    async def create(body: CreateBatch, request: Request) -> Any:
        fid, key = body.input_file_id, caller(request)
        if body.priority not in key.priorities:
            return refuse(403, f"priority {body.priority} is not allowed for this API key (owner {key.owner!r}): it "
                          f"may ask for priorities {key.priorities} (timeslice.batch.key_file)", "priority",
                          "priority_not_allowed")
        over = await asyncio.to_thread(store.queue.quotas.over, key.owner, key.policy)
        if over is not None:  # its running batches pause meanwhile: the claim passes them over
            answer = refuse(429, f"owner {key.owner!r} is over its quota: {over} (timeslice.batch.key_file)", None,
                            "rate_limit_exceeded")
            answer.headers["Retry-After"] = str(over.retry_after_s)
            return answer
        mine = owned(await asyncio.to_thread(store.file, fid), key)  # another owner's file: as missing
        chunks = await asyncio.to_thread(files.chunks, fid) if mine else None
        if chunks is None:
            return refuse(404, f"no input file {fid!r}", "input_file_id", "not_found")
        served = await asyncio.to_thread(models, body.tenant_role)  # what the tenants that answer it serve
        lines = parse_stream(chunks, body.endpoint, served)  # read, checked and inserted as it comes; usable once whole
        try:
            bid = await asyncio.to_thread(store.create_batch, body.endpoint, fid, body.window_s, body.completion_window,
                                          body.metadata, lines, owner=getattr(request.state, "owner", ""),
                                          priority=body.priority, role=body.tenant_role,
                                          admit=etas.admit(key.policy.refuse_late))
        except BatchRefused as exc:  # a bad line, the file deleted meanwhile (409): no batch was made
            return refuse(exc.status, exc.message, exc.param, exc.code)
        kick()
        row = await asyncio.to_thread(store.batch, bid)
        return batch_object(store, row, await asyncio.to_thread(etas.field, row))  # type: ignore[arg-type]

    @app.get("/v1/batches")
    def list_batches(request: Request, limit: int = 20, after: str | None = None) -> Any:
        if not 1 <= limit <= 100:
            return refuse(400, f"limit {limit} is not between 1 and 100", "limit")
        key = caller(request)
        rows = store.batches(limit + 1, after, None if key.admin else key.owner)
        shown = etas.fields(rows[:limit])
        data = [batch_object(store, r, shown[r["id"]]) for r in rows[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}

    @app.get("/v1/batches/{bid}")
    def get_batch(bid: str, request: Request) -> Any:
        row = owned(store.batch(bid), caller(request))
        return batch_object(store, row, etas.field(row)) if row else \
            refuse(404, f"no batch {bid!r}", "batch_id", "not_found")

    @app.post("/v1/batches/{bid}/cancel")
    def cancel(bid: str, request: Request) -> Any:
        row = owned(store.batch(bid), caller(request))
        if row is None:
            return refuse(404, f"no batch {bid!r}", "batch_id", "not_found")
        if row["status"] not in OPEN:
            return refuse(409, f"batch {bid!r} is {row['status']}: it cannot be cancelled", "batch_id", "batch_ended")
        store.cancel(bid)
        row = store.batch(bid)
        return batch_object(store, row, etas.field(row))  # type: ignore[arg-type]


__all__ = ["make_app"]
