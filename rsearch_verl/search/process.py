"""The process-wide search: one `SearchClient` and the `CircuitBreaker` in front of it per retriever config, shared by
every batch a rollout worker (or the driver's validation) generates, so the result cache, the connection pool, the
breaker's failure window and the search metrics span batches. With `retriever.record` / `retriever.replay` the
client holds this process's connections to the SQLite store (rsearch_verl/search/replay.py), opened in the process
that uses them (each Ray worker its own).

    client = process_search_client(cfg.retriever)     # await client(queries, topk, source)
    breaker = process_breaker(cfg.retriever)           # await breaker(queries, topk, source): holds during an outage
"""

from __future__ import annotations

import dataclasses
import json

from rsearch_verl.config import RetrieverConfig
from rsearch_verl.search.breaker import CircuitBreaker
from rsearch_verl.search.client import SearchClient

_PROCESS_SEARCH: dict[str, tuple[SearchClient, CircuitBreaker]] = {}


def process_search_client(retriever: RetrieverConfig) -> SearchClient:
    """The process's one SearchClient for this retriever config (cache, connection pool and metrics shared by every
    batch; it rebinds itself to each new event loop)."""
    return _process_search(retriever)[0]


def process_breaker(retriever: RetrieverConfig) -> CircuitBreaker:
    """The circuit breaker in front of `process_search_client(retriever)` (its failure window spans batches)."""
    return _process_search(retriever)[1]


def _process_search(retriever: RetrieverConfig) -> tuple[SearchClient, CircuitBreaker]:
    key = json.dumps(dataclasses.asdict(retriever), sort_keys=True)
    if key not in _PROCESS_SEARCH:
        client = SearchClient(retriever)
        breaker = CircuitBreaker(client, retriever.breaker, probe=client.healthy, where=_describe(retriever))
        _PROCESS_SEARCH[key] = (client, breaker)
    return _PROCESS_SEARCH[key]


def _describe(retriever: RetrieverConfig) -> str:
    return f"the retriever at {retriever.url}" if retriever.url else "the retriever"
