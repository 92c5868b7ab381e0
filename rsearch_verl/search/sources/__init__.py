"""Search sources: one adapter per backend, all returning `Doc` lists behind the same small interface.

A source turns queries into HTTP request(s) and parses the answer; it never retries, caches or limits
concurrency — `rsearch_verl.search.client.SearchClient` does that for every source alike.

    from rsearch_verl.search.sources import LocalSource, SerperSource, ArxivSource
    sources = {"local": LocalSource("http://127.0.0.1:8000"), "web": SerperSource(api_key=KEY),
               "news": SerperSource(api_key=KEY, kind="news"), "arxiv": ArxivSource()}

Errors: an `httpx.HTTPStatusError` / `httpx.TransportError` propagates (the client decides whether to retry);
an answer that cannot be parsed raises `SourceResponseError` (never retried: the server answered).
"""

from __future__ import annotations

from rsearch_verl.search.sources.arxiv import ArxivSource
from rsearch_verl.search.sources.base import Source, SourceResponseError, make_title_doc
from rsearch_verl.search.sources.local import LocalSource
from rsearch_verl.search.sources.serper import SerperSource

__all__ = ["ArxivSource", "LocalSource", "SerperSource", "Source", "SourceResponseError", "make_title_doc"]
