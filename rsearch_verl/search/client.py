"""Async search client used by the agent loop: timeouts, bounded retries, bounded concurrency, cache, coalescing.

    client = SearchClient(cfg.retriever)                      # local source at cfg.retriever.url
    docs = await client(["who wrote hamlet"], topk=3)         # -> [[Doc, Doc, Doc]]
    docs = await client(["llm agents"], 2, source="arxiv")    # any source registered by name
    pages = await client.documents(["doc7"], page=0)          # -> [DocumentPage]: page 0 of the whole document
    client.metrics()  # {"search/calls": ..., "search/latency_p50": ..., ...}
    await client.aclose()

It is a `SearchFn` (see `rsearch_verl.search.types`). Every HTTP request has a timeout
(`cfg.timeout_s`); timeouts, connection errors and 5xx are retried up to `cfg.max_retries` times with
exponential backoff and jitter; 4xx and unparseable answers are not retried. At most `cfg.max_concurrency`
requests are in flight. For batched sources (our retrieval server) concurrent calls that arrive within
`coalesce_ms` are merged into one POST, so many trajectories asking one query each cost one encoder batch.
A final failure raises `SearchError`; protocols turn it into an error observation and the trajectory goes on.
HTTP 401 / 403 raises `SearchAuthError` instead (not a `SearchError`, so no protocol turns it into an observation and
the circuit breaker does not wait it out): a missing or wrong credential fails every search alike, so the rollout fails
and the driver stops the run naming the variable (`RETRIEVER_TOKEN`, `SERPER_API_KEY`).
With `retriever.record` / `retriever.replay` (rsearch_verl/search/replay.py) a search the cache lacks is looked up in
the replay store first; a miss raises `SearchError("replay_miss")` or goes live, and what goes live is recorded.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx
import numpy as np

from rsearch_verl import signals as sig
from rsearch_verl.config.schema import RetrieverConfig
from rsearch_verl.search.cache import SearchCache
from rsearch_verl.search.replay import NO_INDEX, RecordReplay
from rsearch_verl.search.sources import ArxivSource, LocalSource, SerperSource, Source, SourceResponseError
from rsearch_verl.search.types import Doc, DocumentPage

logger = logging.getLogger(__name__)
T = TypeVar("T")


class SearchError(RuntimeError):
    """A search that failed for good. `kind`: timeout | connection | http_<status> | bad_response | config."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message

    def short(self) -> str:
        """A one-line reason fit for an observation shown to the policy (no stack, no URL)."""
        return self.kind

    @property
    def outage(self) -> bool:
        """The backend is down or overloaded (timeout, connection, HTTP 5xx / 429), not the request at fault: such a
        failure says nothing about the policy, so the circuit breaker counts it and the trainer drops the trajectory."""
        return self.kind in ("timeout", "connection", "http_429") or self.kind.startswith("http_5")


class SearchAuthError(RuntimeError):
    """A source rejected our credential (HTTP 401 / 403). Not an outage and not the policy's doing: the run must stop.
    `variable` is the environment variable that holds the credential."""

    def __init__(self, variable: str, message: str):
        super().__init__(message)
        self.variable = variable


AUTH_STATUSES = (401, 403)


def auth_error(src: Source, status: int, detail: str) -> SearchAuthError:
    """The SearchAuthError for `src` answering `status`: says where, and which variable to set (never its value)."""
    variable = src.secret_env or "the source's credential"
    if not src.secret_env:
        state = "was rejected"
    else:  # the worker's environment is where the credential comes from unless code passed one explicitly
        state = "was rejected" if os.environ.get(src.secret_env) else "is not set in the rollout worker"
    return SearchAuthError(
        variable,
        f"{src.where or src.name} answered HTTP {status} ({detail.strip()[:120]}): {variable} {state}. Export "
        f"{variable} with the server's credential where the run is started (it is forwarded to the Ray workers; "
        "launch/submit.sh forwards it into the job's runtime env) and rerun.",
    )


def default_sources(cfg: RetrieverConfig) -> dict[str, Source]:
    """`local` when `cfg.url` is set; `arxiv` always; `web`/`news` (Serper) only when $SERPER_API_KEY is set."""
    sources: dict[str, Source] = {"arxiv": ArxivSource()}
    if cfg.url:
        sources["local"] = LocalSource(cfg.url, cfg.token)  # token None: $RETRIEVER_TOKEN
    if os.environ.get("SERPER_API_KEY"):
        sources["web"] = SerperSource(kind="search")
        sources["news"] = SerperSource(kind="news")
    return sources


@dataclass
class _Pending:
    """Queries waiting to be merged into one batched request for (source, topk)."""

    queries: list[str] = field(default_factory=list)
    futures: list[asyncio.Future] = field(default_factory=list)


# the sources `default_sources` may make, and where calls to any other go: every rollout worker reports the same
# `search/calls/<source>` keys whatever it was asked (the driver's DataProto.concat requires one key set)
KNOWN_SOURCES = ("local", "arxiv", "web", "news")
OTHER_SOURCE = "other"


@dataclass
class _Cost:
    """One window of cost accounting: seconds inside the client's calls and calls per source."""

    seconds: float = 0.0
    calls: collections.Counter = field(default_factory=collections.Counter)

    def metrics(self, kind: str, reset: bool, sources: list[str]) -> dict[str, float]:
        """`kind/cost_s` and `kind/calls/<source>` for each of `sources` and OTHER_SOURCE (0 when not called)."""
        calls = dict.fromkeys([*sources, OTHER_SOURCE], 0.0)
        for source, n in self.calls.items():
            calls[source if source in calls else OTHER_SOURCE] += n
        out = {sig.cost_s(kind): self.seconds, **{sig.calls_of(kind, s): n for s, n in calls.items()}}
        if reset:
            self.seconds, self.calls = 0.0, collections.Counter()
        return out


def _classify(exc: Exception) -> tuple[SearchError, bool]:
    """(the SearchError to raise, whether the failure is worth retrying)."""
    if isinstance(exc, httpx.TimeoutException):
        return SearchError("timeout", str(exc) or "request timed out"), True
    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
        detail = exc.response.text[:200]
        return SearchError(f"http_{status}", detail), status >= 500 or status == 429
    if isinstance(exc, httpx.TransportError):
        return SearchError("connection", repr(exc)), True
    if isinstance(exc, SourceResponseError):
        return SearchError("bad_response", str(exc)), False
    raise exc


class SearchClient:
    """A `SearchFn` over named sources. Create it once per process; it binds to the running event loop lazily."""

    def __init__(
        self,
        cfg: RetrieverConfig,
        sources: dict[str, Source] | None = None,
        *,
        coalesce_ms: float = 2.0,
        coalesce: bool = True,
        max_batch: int = 256,
        backoff_s: float = 0.1,
        cache_size: int = 100_000,
    ):
        if cfg.timeout_s <= 0 or cfg.max_retries < 0 or cfg.max_concurrency < 1:
            raise ValueError("retriever timeout_s must be > 0, max_retries >= 0, max_concurrency >= 1")
        self.cfg = cfg
        self.sources = dict(sources) if sources is not None else default_sources(cfg)
        self.coalesce_s = coalesce_ms / 1000.0
        self.coalesce = coalesce  # False: one request per call (for comparisons; batched sources still batch a call)
        self.max_batch = max_batch
        self.backoff_s = backoff_s
        self.cache = SearchCache(cache_size) if cfg.cache else None
        # retriever.record / retriever.replay (rsearch_verl/search/replay.py); None when neither is set
        self.record_replay = RecordReplay(cfg) if cfg.record or cfg.replay else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._latencies: deque[float] = deque(maxlen=10_000)
        self._counts = {"calls": 0, "queries": 0, "requests": 0, "errors": 0, "retries": 0, "cache_hits": 0}
        self._doc_counts = {"calls": 0, "requests": 0, "errors": 0, "retries": 0}  # documents(): its own counters
        # cost accounting: seconds inside calls (summed over concurrent calls) and calls per source, per window
        self._cost = _Cost()
        self._doc_cost = _Cost()

    # ---- public API -------------------------------------------------------------------------------------------
    async def __call__(self, queries: list[str], topk: int, source: str = "local") -> list[list[Doc]]:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        self._counts["calls"] += 1
        self._counts["queries"] += len(queries)
        self._cost.calls[source] += 1
        rr = self.record_replay
        if source not in self.sources and (rr is None or rr.replay is None):  # a replay store may know the source
            self._counts["errors"] += 1
            raise SearchError("config", f"unknown search source {source!r}; known: {sorted(self.sources)}")
        self._bind_loop()
        start = time.perf_counter()
        results: list[list[Doc] | None] = [None] * len(queries)
        todo: list[int] = []
        for i, query in enumerate(queries):
            hit = self.cache.get((source, topk, query)) if self.cache is not None else None
            if hit is not None:
                results[i] = hit
                self._counts["cache_hits"] += 1
            else:
                todo.append(i)
        try:
            if todo and rr is not None and rr.replay is not None:
                todo = self._replayed(source, topk, queries, todo, results)
            if todo:
                fetched = await self._fetch_live(source, [queries[i] for i in todo], topk)
                for i, docs in zip(todo, fetched, strict=True):
                    results[i] = docs
                    if self.cache is not None:
                        self.cache.put((source, topk, queries[i]), docs)
        except SearchError:
            self._counts["errors"] += 1
            raise
        finally:
            self._latencies.append(time.perf_counter() - start)
            self._cost.seconds += self._latencies[-1]
        return results  # type: ignore[return-value]

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """Counters (calls, queries, HTTP requests, errors, retries, cache hits; with record / replay also replay
        hits and misses of searches and documents() alike, entries recorded and in the store), the cost
        (`search/cost_s`: seconds inside search calls, summed over concurrent ones; `search/calls/<source>`) and call
        latency percentiles in seconds over the last 10k calls; `reset=True` starts a new window (per-step logging)."""
        out = {f"search/{k}": float(v) for k, v in self._counts.items()}
        out.update(self._cost.metrics("search", reset, self._cost_sources()))
        if self.record_replay is not None:
            out.update(self.record_replay.metrics(reset))
        lat = np.asarray(self._latencies, dtype=float)
        out["search/latency_p50"] = float(np.percentile(lat, 50)) if lat.size else 0.0
        out["search/latency_p99"] = float(np.percentile(lat, 99)) if lat.size else 0.0
        if reset:
            self._counts = dict.fromkeys(self._counts, 0)
            self._latencies.clear()
        return out

    async def documents(self, ids: list[str], page: int = 0, source: str = "local") -> list[DocumentPage]:
        """Page `page` (0-based) of each whole document in `ids`, in order (POST /documents of our retrieval server;
        page size: its --page-tokens). Same timeout, bounded retries (timeouts, connection errors, 5xx / 429) and
        errors as a search: SearchError `http_404` for an unknown id, `http_422` for a page past a document's end or
        a request the server refuses, `timeout` / `connection` / `http_5xx` once the retries are spent, `config` for
        a source without documents; SearchAuthError on 401 / 403. Not cached and not coalesced. Recorded and replayed
        like a search (`{"tool": "open", ...}` keys), a replay miss raising SearchError("replay_miss") the same way."""
        if not ids or page < 0:
            raise ValueError(f"documents() needs at least one id and a page >= 0, got {len(ids)} ids, page {page}")
        self._doc_counts["calls"] += 1
        self._doc_cost.calls[source] += 1
        rr = self.record_replay
        if source not in self.sources and (rr is None or rr.replay is None):
            self._doc_counts["errors"] += 1
            raise SearchError("config", f"unknown search source {source!r}; known: {sorted(self.sources)}")
        self._bind_loop()
        start = time.perf_counter()
        try:
            return await self._documents(source, list(ids), int(page))
        except SearchError:
            self._doc_counts["errors"] += 1
            raise
        finally:
            self._doc_cost.seconds += time.perf_counter() - start

    def document_metrics(self, reset: bool = False) -> dict[str, float]:
        """`documents()`'s counters (calls, HTTP requests, errors, retries) and cost (`documents/cost_s`,
        `documents/calls/<source>`), kept apart from the searches' metrics (its replay hits / misses are theirs)."""
        out = {f"documents/{k}": float(v) for k, v in self._doc_counts.items()}
        out.update(self._doc_cost.metrics("documents", reset, self._cost_sources()))
        if reset:
            self._doc_counts = dict.fromkeys(self._doc_counts, 0)
        return out

    async def healthy(self, source: str = "local") -> bool:
        """One health probe of `source` (GET /health for the local retriever), bounded by `cfg.timeout_s`."""
        self._bind_loop()
        return await self.sources[source].healthy(self._http, self.cfg.timeout_s)

    async def aclose(self) -> None:
        """Close the connection pool (it is reopened on the next call)."""
        http, self._http = self._http, None
        # a pool made on an earlier (now closed) loop cannot be closed from this one; its sockets died with it
        if http is not None and self._loop is asyncio.get_running_loop():
            await http.aclose()

    # ---- internals --------------------------------------------------------------------------------------------
    def _cost_sources(self) -> list[str]:
        return sorted({*self.sources, *KNOWN_SOURCES} - {OTHER_SOURCE})

    def _replayed(
        self, source: str, topk: int, queries: list[str], todo: list[int], results: list[list[Doc] | None]
    ) -> list[int]:
        """Fill `results` from the replay store; return the indices it lacks. With retriever.replay_miss=error a
        miss raises SearchError("replay_miss") (an error observation, like any failed search)."""
        rr = self.record_replay
        found = rr.lookup(source, topk, [queries[i] for i in todo])
        missing = []
        for i, docs in zip(todo, found, strict=True):
            if docs is None:
                missing.append(i)
                continue
            results[i] = docs
            if self.cache is not None:
                self.cache.put((source, topk, queries[i]), docs)
        if missing and not rr.live_misses:
            raise SearchError(
                "replay_miss",
                f"{len(missing)} of {len(queries)} queries (topk={topk}, source={source}) are not in {rr.where} "
                "(retriever.replay_miss=error)",
            )
        return missing

    async def _documents(self, source: str, ids: list[str], page: int) -> list[DocumentPage]:
        """The pages from the replay store where it has them, the rest from the live source (recorded)."""
        rr = self.record_replay
        pages: list[DocumentPage | None] = [None] * len(ids)
        if rr is not None and rr.replay is not None:
            pages = rr.lookup_pages(source, page, ids)
        todo = [i for i, p in enumerate(pages) if p is None]
        if todo and rr is not None and rr.replay is not None and not rr.live_misses:
            raise SearchError(
                "replay_miss",
                f"{len(todo)} of {len(ids)} documents (page={page}, source={source}) are not in {rr.where} "
                "(retriever.replay_miss=error)",
            )
        if todo:
            fetched = await self._pages_live(source, [ids[i] for i in todo], page)
            for i, fetched_page in zip(todo, fetched, strict=True):
                pages[i] = fetched_page
        return pages  # type: ignore[return-value]

    async def _pages_live(self, source: str, ids: list[str], page: int) -> list[DocumentPage]:
        """POST /documents of the live source with retries; with record / replay pinned first, recorded after."""
        if source not in self.sources:
            raise SearchError("config", f"unknown search source {source!r}; known: {sorted(self.sources)}")
        src, rr = self.sources[source], self.record_replay

        def call() -> Awaitable[list[DocumentPage]]:
            return src.documents(self._http, ids, page, self.cfg.timeout_s)

        if rr is not None:
            await rr.ensure_pinned(self._index_fingerprint)
        try:
            fetched = await self._with_retries(src, call, self._doc_counts, "documents")
        except NotImplementedError as exc:
            raise SearchError("config", str(exc)) from exc
        if rr is not None:
            await rr.record_pages(source, page, ids, fetched)
        return fetched

    async def _fetch_live(self, source: str, queries: list[str], topk: int) -> list[list[Doc]]:
        """`_fetch` from the real source; with record / replay pinned to its index first, and recorded after."""
        if source not in self.sources:
            raise SearchError("config", f"unknown search source {source!r}; known: {sorted(self.sources)}")
        rr = self.record_replay
        if rr is None:
            return await self._fetch(source, queries, topk)
        await rr.ensure_pinned(self._index_fingerprint)
        fetched = await self._fetch(source, queries, topk)
        await rr.record(source, topk, queries, fetched)
        return fetched

    async def _index_fingerprint(self) -> str:
        """The local retriever's index fingerprint (GET /health), what a record / replay store is pinned to."""
        src = self.sources.get("local")
        if src is None:
            return NO_INDEX
        try:
            async with self._sem:
                return await src.fingerprint(self._http, self.cfg.timeout_s) or NO_INDEX
        except (httpx.HTTPError, SourceResponseError) as exc:
            if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in AUTH_STATUSES:
                raise auth_error(src, exc.response.status_code, exc.response.text) from exc
            raise _classify(exc)[0] from exc

    def _bind_loop(self) -> None:
        # asyncio primitives and the httpx pool belong to one event loop; a new loop (e.g. a fresh asyncio.run per
        # rollout batch) gets fresh ones instead of "attached to a different loop" errors.
        loop = asyncio.get_running_loop()
        if loop is not self._loop or self._http is None:
            self._loop = loop
            limits = httpx.Limits(max_connections=self.cfg.max_concurrency)
            self._http = httpx.AsyncClient(limits=limits, timeout=self.cfg.timeout_s)
            self._sem = asyncio.Semaphore(self.cfg.max_concurrency)
            self._pending = {}

    async def _fetch(self, source: str, queries: list[str], topk: int) -> list[list[Doc]]:
        src = self.sources[source]
        if src.batched:
            if self.coalesce:
                return await self._coalesced(source, queries, topk)
            return await self._request(src, queries, topk)
        # one request per query; run them concurrently (the semaphore still bounds them)
        per_query = await asyncio.gather(*(self._request(src, [q], topk) for q in queries), return_exceptions=True)
        for res in per_query:
            if isinstance(res, BaseException):
                raise res
        return [res[0] for res in per_query]  # type: ignore[index]

    async def _coalesced(self, source: str, queries: list[str], topk: int) -> list[list[Doc]]:
        key = (source, topk)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending()
            asyncio.get_running_loop().call_later(self.coalesce_s, self._flush, key)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in queries]
        pending.queries.extend(queries)
        pending.futures.extend(futures)
        if len(pending.queries) >= self.max_batch:
            self._flush(key)
        return list(await asyncio.gather(*futures))

    def _flush(self, key: tuple[str, int]) -> None:
        pending = self._pending.pop(key, None)
        if pending is None or not pending.queries:
            return  # already flushed because the batch filled up before the timer fired
        asyncio.ensure_future(self._run_batch(key, pending))

    async def _run_batch(self, key: tuple[str, int], pending: _Pending) -> None:
        source, topk = key
        try:
            # the server may dedupe nothing: send each distinct query once and fan results back out
            unique = list(dict.fromkeys(pending.queries))
            docs = await self._request(self.sources[source], unique, topk)
            by_query = dict(zip(unique, docs, strict=True))
            for query, fut in zip(pending.queries, pending.futures, strict=True):
                if not fut.done():
                    fut.set_result(by_query[query])
        except BaseException as exc:  # every waiter must wake up, whatever went wrong
            for fut in pending.futures:
                if not fut.done():
                    fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise

    async def _request(self, src: Source, queries: list[str], topk: int) -> list[list[Doc]]:
        """One logical search request with bounded retries and exponential backoff; raises SearchError at the end."""

        def call() -> Awaitable[list[list[Doc]]]:
            return src.search(self._http, queries, topk, self.cfg.timeout_s)

        return await self._with_retries(src, call, self._counts, "search")

    async def _with_retries(
        self, src: Source, call: Callable[[], Awaitable[T]], counts: dict[str, int], what: str
    ) -> T:
        """`call()` (one HTTP request to `src`) under the concurrency bound, retried with exponential backoff on
        timeouts, connection errors and 5xx / 429 up to `cfg.max_retries` times; `counts` gets its requests and
        retries. Raises SearchError when it fails for good, SearchAuthError on 401 / 403."""
        assert self._http is not None and self._sem is not None
        attempt = 0
        while True:
            try:
                async with self._sem:
                    counts["requests"] += 1
                    return await call()
            except (httpx.HTTPError, SourceResponseError) as exc:
                if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in AUTH_STATUSES:
                    # every retry and every other search would meet the same answer: stop, do not observe it
                    raise auth_error(src, exc.response.status_code, exc.response.text) from exc
                err, retryable = _classify(exc)
                if not retryable or attempt >= self.cfg.max_retries:
                    logger.warning("%s on %s failed after %d attempt(s): %s", what, src.name, attempt + 1, err)
                    raise err from exc
                attempt += 1
                counts["retries"] += 1
                # exponential backoff with jitter so many trajectories retrying together do not stampede the server
                await asyncio.sleep(self.backoff_s * (2 ** (attempt - 1)) * (0.5 + random.random()))
