"""The retrieval server's HTTP side: `create_app(config, retriever)` builds a FastAPI app (no module globals).

API (wire-compatible with Search-R1's `retrieval_server.py`, so either side can talk to the other):

    POST /retrieve  {"queries": [str, ...], "topk": int | null, "return_scores": bool}
        -> {"result": [[{"document": {"id", "contents"}, "score": float}, ...], ...]}   (return_scores true)
        -> {"result": [[{"id", "contents"}, ...], ...]}                                 (return_scores false)
    POST /documents {"ids": [str, ...], "page": int (0-based, default 0)}
        -> {"result": [{"id", "contents", "page", "pages"}, ...]}   a page (--page-tokens words) of each document
    GET  /health    -> {"status": "ok", "n_docs", "n_documents", "encoder", "index_type", "mode", "auth", "limits", ...}

A chunked index's passages (`build --chunk-tokens N`) carry their document's id as `doc_id` in /retrieve's documents;
an unchunked index's passages are their own documents (`id`), and its /retrieve answers are exactly as before.

Bad input is answered 4xx with `{"detail": "..."}` (400 malformed JSON, 401 missing/wrong bearer token, 404 unknown
document id, 413 body too large, 422 wrong types / empty / over a limit / a page past the document's end); a 500 only
means a bug or a broken index, never client input.

/retrieve is a pure ASGI handler (`RetrieveFastPath`): raw-bytes parsing with orjson, requests coalesced by
`MicroBatcher` into `retriever.search` calls on up to `workers` threads, responses serialised on those threads. The
throughput benchmark's Search-R1-like baseline (rsearch_verl/testing/searchr1_server.py) serves the same index with
this module's token check, body parsing, limits and search, one request at a time, so it compares like with like.

Run it with `python -m retrieval_server serve --index DIR` (see `__main__.py`).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import os
from collections.abc import Sequence
from typing import Any

import orjson
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from retrieval_server.batching import MicroBatcher
from retrieval_server.config import ServerConfig
from retrieval_server.documents import PageOutOfRange, paginate

logger = logging.getLogger(__name__)

Job = tuple[list[str], int, bool]  # (queries, topk, return_scores) of one request


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Pure ASGI middleware (cheap: no per-request task) that refuses bodies over `max_bytes` with 413.

    Checks Content-Length up front and counts the bytes actually received, so a chunked upload cannot slip past.
    """

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit() or int(value) > self.max_bytes:
                    await _send_json(send, 413, f"request body larger than {self.max_bytes} bytes")
                    return
                break
        received = 0
        started = False

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _send_json(send, 413, f"request body larger than {self.max_bytes} bytes")


async def _send_json(send: Any, status: int, detail: str, extra: list | None = None) -> None:
    await _send_bytes(send, status, orjson.dumps({"detail": detail}), extra)


async def _send_bytes(send: Any, status: int, body: bytes, extra: list | None = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RetrieveFastPath:
    """The server's /retrieve, as pure ASGI in front of the router: no route matching, no Request / Response
    objects, no exception middleware per request (~10 % more QPS at 64 clients on 2 cores, where the event loop
    shares the GIL with the search threads). 401 without the token, 400 / 422 with a message for bad bodies, 405
    for other methods, the batcher's JSON bytes otherwise. Other paths fall through to the app."""

    def __init__(self, app: Any, config: ServerConfig, batcher: MicroBatcher):
        self.app, self.config, self.batcher = app, config, batcher

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/retrieve":
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            await _send_json(send, 405, "Method Not Allowed", [(b"allow", b"POST")])
            return
        authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            check_token(self.config, authorization)
            job = parse_retrieve_body(self.config, body)
        except HTTPException as exc:
            extra = [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
            await _send_json(send, exc.status_code, str(exc.detail), extra)
            return
        await _send_bytes(send, 200, await self.batcher.submit(job, n_queries=len(job[0])))


def check_strings(values: Any, name: str, most: int, max_chars: int) -> None:
    """A request's list of strings (queries, document ids): a non-empty list of at most `most` non-blank strings of
    at most `max_chars` characters; HTTPException(422) naming the problem."""
    if not isinstance(values, list):
        raise HTTPException(422, f"'{name}' must be a list of strings")
    if not values:
        raise HTTPException(422, f"'{name}' must not be empty")
    if len(values) > most:
        raise HTTPException(422, f"too many {name}: {len(values)} > {most}")
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise HTTPException(422, f"{name}[{i}] must be a string")
        if not value.strip():
            raise HTTPException(422, f"{name}[{i}] is empty")
        if len(value) > max_chars:
            raise HTTPException(422, f"{name}[{i}] longer than {max_chars} characters")


def check_limits(config: ServerConfig, queries: Any, topk: Any, return_scores: Any) -> Job:
    """Validate one request's fields (already JSON-decoded); raise HTTPException(422) naming the problem."""
    check_strings(queries, "queries", config.max_queries, config.max_query_chars)
    if topk is None:
        topk = config.default_topk
    # bool is an int subclass in Python: `"topk": true` must not mean topk=1.
    if not isinstance(topk, int) or isinstance(topk, bool):
        raise HTTPException(422, "'topk' must be an integer or null")
    if not 1 <= topk <= config.max_topk:
        raise HTTPException(422, f"'topk' must be in [1, {config.max_topk}], got {topk}")
    if not isinstance(return_scores, bool):
        raise HTTPException(422, "'return_scores' must be a boolean")
    return queries, topk, return_scores


def _json_object(body: bytes) -> dict:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HTTPException(400, f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise HTTPException(422, "body must be a JSON object")
    return data


def parse_retrieve_body(config: ServerConfig, body: bytes) -> Job:
    """Decode and validate a raw /retrieve body (no pydantic)."""
    data = _json_object(body)
    if "queries" not in data:
        raise HTTPException(422, "missing field 'queries'")
    return check_limits(config, data["queries"], data.get("topk"), data.get("return_scores", False))


def parse_documents_body(config: ServerConfig, body: bytes) -> tuple[list[str], int]:
    """Decode and validate a raw /documents body into (ids, page); HTTPException(400 / 422) naming the problem."""
    data = _json_object(body)
    if "ids" not in data:
        raise HTTPException(422, "missing field 'ids'")
    ids = data["ids"]
    check_strings(ids, "ids", config.max_document_ids, config.max_query_chars)
    page = data.get("page")
    page = 0 if page is None else page
    if not isinstance(page, int) or isinstance(page, bool):  # `"page": true` must not mean page 1
        raise HTTPException(422, "'page' must be an integer or null")
    if page < 0:
        raise HTTPException(422, f"'page' must be >= 0, got {page}")
    return ids, page


def read_documents(store: Any, ids: list[str], page: int, page_tokens: int) -> list[dict]:
    """Page `page` of each document in `ids` from `store` (a DocumentStore, or None for an index without documents);
    HTTPException 404 naming the unknown ids, 422 for a page past a document's end."""
    if store is None:
        raise HTTPException(
            404, "this index stores no documents (built before /documents existed): rebuild it to serve documents"
        )
    found = store.get(ids)
    missing = [doc_id for doc_id in dict.fromkeys(ids) if doc_id not in found]
    if missing:
        named = ", ".join(repr(m[:200]) for m in missing[:5])
        if len(missing) > 5:
            named += f" and {len(missing) - 5} more"
        raise HTTPException(404, f"unknown document id{'s' if len(missing) > 1 else ''}: {named}")
    out = []
    for doc_id in ids:
        try:
            contents, pages = paginate(found[doc_id], page, page_tokens)
        except PageOutOfRange as exc:
            raise HTTPException(
                422, f"page {page} is past the end of document {doc_id[:200]!r} ({exc.pages} pages: 0..{exc.pages - 1})"
            ) from None
        out.append({"id": doc_id, "contents": contents, "page": page, "pages": pages})
    return out


def format_results(
    jobs: Sequence[Job], rows: Sequence[Sequence[int]], scores: Sequence[Sequence[float]], docs: list[dict]
) -> list[list[list[Any]]]:
    """Split one batch's search output back per job in Search-R1's wire format.

    `rows`/`scores` hold one list per query of all jobs in order; `docs` the documents of every row, flattened.
    """
    out = []
    qi = 0
    di = 0
    for queries, topk, with_scores in jobs:
        per_job = []
        for _ in queries:
            n_row = len(rows[qi])
            keep = min(topk, n_row)
            if with_scores:
                per_job.append([{"document": docs[di + j], "score": float(scores[qi][j])} for j in range(keep)])
            else:
                per_job.append(docs[di : di + keep])
            di += n_row
            qi += 1
        out.append(per_job)
    return out


def search_jobs(retriever: Any, jobs: Sequence[Job], chunk: int = 64) -> list[list[list[Any]]]:
    """Search all queries of `jobs`, `chunk` queries per encoder forward + index search (so a 4096-query request
    holds one chunk's activations and candidate lists at a time), results split back per job."""
    queries = [q for job in jobs for q in job[0]]
    k = max(job[1] for job in jobs)
    rows: list = []
    scores: list = []
    for start in range(0, len(queries), chunk):
        r, s = retriever.search(queries[start : start + chunk], k)
        rows.extend(r)
        scores.extend(s)
    docs = retriever.docs([int(r) for per_query in rows for r in per_query])
    return format_results(jobs, rows, scores, docs)


def check_token(config: ServerConfig, authorization: str | None) -> None:
    """Raise HTTPException(401) unless the `Authorization` header carries the configured bearer token."""
    if config.token is None:
        return
    expected = f"Bearer {config.token}"
    if authorization is None or not hmac.compare_digest(authorization.encode(), expected.encode()):
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


def share_cores(running: int, cpus: int) -> None:
    """Torch threads for the calling batch thread: all `cpus` when it runs alone, a share when `running` batches
    run at once (torch keeps the intra-op thread count per calling thread)."""
    import torch  # heavy: torch kept out of the app's import (a BM25 index and the tests need none)

    torch.set_num_threads(max(1, cpus // running))


def create_app(config: ServerConfig, retriever: Any) -> FastAPI:
    """Build the app serving `retriever` (a `retrieval_server.retriever.Retriever`) under `config`."""
    config = config.validated()

    def run_batch(jobs: list[Job]) -> list[bytes]:
        # Serialise on the search thread too: the event loop only moves bytes.
        return [orjson.dumps({"result": r}) for r in search_jobs(retriever, jobs, config.batch_max)]

    batcher = MicroBatcher(
        run_batch,
        batch_max=config.batch_max,
        batch_wait_ms=config.batch_wait_ms,
        workers=config.workers,
        on_start=functools.partial(share_cores, cpus=config.own_cpus()) if config.workers > 1 else None,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        batcher.close()

    app = FastAPI(title="rsearch-verl retrieval server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config = config
    app.state.retriever = retriever
    app.state.batcher = batcher
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return health_body(config, retriever, "batched", batcher.stats.as_dict())

    add_documents_route(app, config, getattr(retriever, "documents", None))

    app.add_middleware(RetrieveFastPath, config=config, batcher=batcher)  # inside the body limit (added next)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    return app


def add_documents_route(app: FastAPI, config: ServerConfig, store: Any) -> None:
    """POST /documents on `app`: pages of whole documents from `store` (retrieval_server/documents.py)."""

    @app.post("/documents")
    async def documents(request: Request) -> Response:
        check_token(config, request.headers.get("authorization"))
        ids, page = parse_documents_body(config, await request.body())
        # SQLite and the paging off the event loop: a long document costs milliseconds
        result = await run_in_threadpool(read_documents, store, ids, page, config.page_tokens)
        return Response(orjson.dumps({"result": result}), media_type="application/json")


def health_body(config: ServerConfig, retriever: Any, mode: str, batching: dict | None) -> dict:
    """GET /health's answer: the index (size, encoder, type), who answered, auth, limits and batching stats."""
    info = dict(getattr(retriever, "info", {}))
    return {
        "status": "ok",
        **info,
        "pid": os.getpid(),  # which process answered: a Ray Serve replica, or the single server
        "n_docs": retriever.n_docs,  # passages (index rows)
        "n_documents": info.get("n_documents"),  # whole documents served by /documents (None: none stored)
        "encoder": info.get("encoder"),
        "index_type": info.get("index_type"),
        "mode": mode,
        "auth": config.token is not None,
        "limits": {
            "max_queries": config.max_queries,
            "max_query_chars": config.max_query_chars,
            "max_topk": config.max_topk,
            "max_body_bytes": config.max_body_bytes,
            "page_tokens": config.page_tokens,
            "max_document_ids": config.max_document_ids,
        },
        "batching": batching,
    }


def add_error_handlers(app: FastAPI) -> None:
    """Every error as `{"detail": "..."}`: 422 for a body FastAPI rejects, 500 (logged) for a bug."""

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # Flatten pydantic's error list into one readable string: the contract is {"detail": "..."}.
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in exc.errors()]
        return JSONResponse({"detail": "; ".join(parts) or "invalid request"}, status_code=422)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error: %r", exc)
        return JSONResponse({"detail": "internal server error"}, status_code=500)
