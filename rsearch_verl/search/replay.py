"""Record and replay of search results: the `SearchClient`'s layer over the SQLite store (rsearch_verl/search/store.py).

    retriever.record=/shared/nq.sqlite                          # every new (source, index, topk, query) -> result
    retriever.replay=/shared/nq.sqlite retriever.replay_miss=error   # answered from the store only; no retriever
    retriever.replay=A retriever.replay_miss=live [retriever.record=A]  # misses go live (and are recorded)

A search is keyed `{"tool": "search", "source", "index", "topk", "query"}`, a page of a whole document
(`SearchClient.documents`, the `open` tool) `{"tool": "open", "source", "index", "id", "page"}`; `index` is the
fingerprint of the index the store is pinned to (retrieval_server/fingerprint.py, reported by GET /health). Pinning: a
store records against one index. Before the first live search a recording (or live-missing) client asks the local
retriever for its fingerprint and pins every store it uses to it; a store pinned to another index raises
`StoreMismatchError`, naming both, instead of mixing two indexes' results (a run stops on it, like on a rejected
credential: rsearch_verl/trainer/run_control.py). A replay-only client (replay_miss=error) takes the fingerprint from
the store itself and makes no network call at all. A source with no index of its own (web APIs) is keyed by the same
pinned fingerprint, so a store is one run's view of the world.

    rr = RecordReplay(cfg.retriever)
    hits = rr.lookup("local", 3, ["q1", "q2"])          # [list[Doc] | None, ...]
    await rr.ensure_pinned(live_fingerprint)            # before a live search (record or replay_miss=live)
    await rr.record("local", 3, ["q2"], [docs])         # one transaction, on the store's writer thread
    pages = rr.lookup_pages("local", 0, ["doc7"])       # [DocumentPage | None, ...]
    await rr.record_pages("local", 0, ["doc7"], pages)  # the same for documents()
    rr.metrics(reset=True)   # search/replay_hits, search/replay_misses, search/record_writes, search/store_entries
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from rsearch_verl.config.schema import RetrieverConfig
from rsearch_verl.search.store import ResultStore, check_fingerprint, on_network_filesystem
from rsearch_verl.search.types import Doc, DocumentPage

logger = logging.getLogger(__name__)
T = TypeVar("T")

NO_INDEX = "none"  # the fingerprint of a run without a local retriever (web sources only)
REPLAY_HITS = "search/replay_hits"
REPLAY_MISSES = "search/replay_misses"
RECORD_WRITES = "search/record_writes"
STORE_ENTRIES = "search/store_entries"


def search_key(fingerprint: str | None, source: str, topk: int, query: str) -> dict:
    """The store key of one search (the store itself does not care what a key holds)."""
    return {"tool": "search", "source": source, "index": fingerprint, "topk": int(topk), "query": query}


def page_key(fingerprint: str | None, source: str, doc_id: str, page: int) -> dict:
    """The store key of one page of one whole document (`SearchClient.documents`, the `open` tool)."""
    return {"tool": "open", "source": source, "index": fingerprint, "id": doc_id, "page": int(page)}


def docs_to_json(docs: list[Doc]) -> list[dict]:
    return [dataclasses.asdict(d) for d in docs]


def docs_from_json(rows: list[dict]) -> list[Doc]:
    return [Doc(**row) for row in rows]


def open_stores(cfg: RetrieverConfig) -> tuple[ResultStore | None, ResultStore | None]:
    """(replay store, record store) of `cfg`; one object when both name the same file. A replay store must exist
    unless it is also the record store (a recording that resumes from what it has)."""
    same = bool(cfg.record and cfg.replay) and os.path.abspath(cfg.record) == os.path.abspath(cfg.replay)
    replay = ResultStore(cfg.replay, create=same) if cfg.replay else None
    record = replay if same else (ResultStore(cfg.record) if cfg.record else None)
    for key, store in (("record", record), ("replay", replay)):
        if store is not None and on_network_filesystem(store.path):
            logger.warning(
                "retriever.%s=%s is on a network filesystem: SQLite's WAL mode needs shared memory between the "
                "processes using it and is unsafe there (docs/search_backends.md)",
                key,
                store.path,
            )
    return replay, record


class RecordReplay:
    """The record / replay state of one `SearchClient` (one per process): its stores, pinned fingerprint, counters."""

    def __init__(self, cfg: RetrieverConfig):
        self.replay, self.store = open_stores(cfg)  # self.store: the record store
        self.miss_live = cfg.replay_miss == "live"
        self.where = f"retriever.replay={cfg.replay}" if cfg.replay else ""
        # the index this client's entries belong to: the replay store's until a live index pins it
        self.fingerprint: str | None = self.replay.fingerprint if self.replay is not None else None
        self._pinned = False  # checked against the live index (and the record store pinned to it)
        self._pin_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._counts = {REPLAY_HITS: 0, REPLAY_MISSES: 0, RECORD_WRITES: 0}
        # writes run on one thread of their own (one connection, kept across event loops), off the event loop
        self._writer: ThreadPoolExecutor | None = None

    async def _in_writer(self, fn: Callable[..., T], *args) -> T:
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="search-store")
        return await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    @property
    def live_misses(self) -> bool:
        """A query the replay store lacks is asked of the real retriever (no replay store: every query is)."""
        return self.replay is None or self.miss_live

    def lookup(self, source: str, topk: int, queries: list[str]) -> list[list[Doc] | None]:
        """The replayed result of each query (None: a miss); counts hits and misses."""
        found = self._lookup(lambda fp: [search_key(fp, source, topk, q) for q in queries])
        return [docs_from_json(rows) if rows is not None else None for rows in found]

    def lookup_pages(self, source: str, page: int, ids: list[str]) -> list[DocumentPage | None]:
        """The replayed page `page` of each document in `ids` (None: a miss); counted like searches."""
        found = self._lookup(lambda fp: [page_key(fp, source, i, page) for i in ids])
        return [DocumentPage(**row) if row is not None else None for row in found]

    def _lookup(self, keys: Callable[[str | None], list[dict]]) -> list:
        """The stored result of each of `keys(fingerprint)` (None: a miss), counted in the replay hits / misses."""
        if self.replay is None:
            return [None] * len(keys(self.fingerprint))
        if self.fingerprint is None:  # an empty store until now: another process may have pinned it since
            self.fingerprint = self.replay.fingerprint
        requests = keys(self.fingerprint)
        found = self.replay.get_many(requests) if self.fingerprint is not None else [None] * len(requests)
        hits = sum(row is not None for row in found)
        self._counts[REPLAY_HITS] += hits
        self._counts[REPLAY_MISSES] += len(found) - hits
        return found

    async def ensure_pinned(self, live_fingerprint: Callable[[], Awaitable[str]]) -> None:
        """Once per client, before its first live search: pin the record store to the live index's fingerprint and
        check the replay store against it (StoreMismatchError naming both). `live_fingerprint` may raise (a
        SearchError when the retriever is down): the next live search tries again."""
        if self._pinned:
            return
        loop = asyncio.get_running_loop()
        if self._pin_lock is None or self._loop is not loop:
            self._loop, self._pin_lock = loop, asyncio.Lock()
        async with self._pin_lock:
            if self._pinned:
                return
            fingerprint = await live_fingerprint()
            if self.replay is not None and self.replay is not self.store:
                check_fingerprint(self.replay.path, self.replay.fingerprint, fingerprint)
            if self.store is not None:
                await self._in_writer(self.store.pin, fingerprint)
            self.fingerprint, self._pinned = fingerprint, True
            logger.info("search record/replay pinned to the index with fingerprint %s", fingerprint)

    async def record(self, source: str, topk: int, queries: list[str], results: list[list[Doc]]) -> None:
        """Write each (query, result) the record store lacks, in one transaction on the writer thread."""
        keys = [search_key(self.fingerprint, source, topk, q) for q in queries]
        await self._put(zip(keys, [docs_to_json(docs) for docs in results], strict=True))

    async def record_pages(self, source: str, page: int, ids: list[str], pages: list[DocumentPage]) -> None:
        """Write each document page the record store lacks (one transaction), keyed by the id asked for."""
        keys = [page_key(self.fingerprint, source, i, page) for i in ids]
        await self._put(zip(keys, [dataclasses.asdict(p) for p in pages], strict=True))

    async def _put(self, items) -> None:
        if self.store is not None:
            self._counts[RECORD_WRITES] += await self._in_writer(self.store.put_many, list(items))

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """Hits, misses and new entries written since the last reset, and the entries now in the store."""
        out = {k: float(v) for k, v in self._counts.items()}
        store = self.store if self.store is not None else self.replay
        out[STORE_ENTRIES] = float(len(store)) if store is not None else 0.0
        if reset:
            self._counts = dict.fromkeys(self._counts, 0)
        return out

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        for store in {id(s): s for s in (self.replay, self.store) if s is not None}.values():
            store.close()
