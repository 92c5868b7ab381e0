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

from abc import ABC, abstractmethod

import httpx

from rsearch_verl.rollout.protocols.base import Doc


class SourceResponseError(ValueError):
    """The server answered 2xx but the body is not what the source expects."""


class Source(ABC):
    """One search backend. `batched` sources take many queries in one request (the client coalesces for them)."""

    name: str = ""
    batched: bool = False

    @abstractmethod
    async def search(self, http: httpx.AsyncClient, queries: list[str], topk: int, timeout_s: float) -> list[list[Doc]]:
        """One list of Docs per query, in order. Non-batched sources get exactly one query."""

    async def healthy(self, http: httpx.AsyncClient, timeout_s: float) -> bool:
        """Whether the backend answers its health check (the circuit breaker's probe). Sources without one say
        yes, so a paused search simply tries again."""
        return True


def make_title_doc(doc_id: str, title: str, text: str, score: float, source: str) -> Doc:
    """A Doc in the corpus shape '"Title"\\ntext' (web sources write the same shape as the local corpus)."""
    title = " ".join(str(title or "").split())
    return Doc(id=str(doc_id), contents=f'"{title}"\n{str(text or "").strip()}', score=float(score), source=source)


from rsearch_verl.search.sources.arxiv import ArxivSource  # noqa: E402
from rsearch_verl.search.sources.local import LocalSource  # noqa: E402
from rsearch_verl.search.sources.serper import SerperSource  # noqa: E402

__all__ = ["ArxivSource", "LocalSource", "SerperSource", "Source", "SourceResponseError", "make_title_doc"]
