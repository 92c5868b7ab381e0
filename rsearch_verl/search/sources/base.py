"""The interface every search source implements (`Source`), its parse error and the corpus-shaped Doc helper.

The adapters (local.py, serper.py, arxiv.py) subclass `Source`; rsearch_verl/search/sources/__init__.py exports
them all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import httpx

from rsearch_verl.search.types import Doc, DocumentPage


class SourceResponseError(ValueError):
    """The server answered 2xx but the body is not what the source expects."""


class Source(ABC):
    """One search backend. `batched` sources take many queries in one request (the client coalesces for them)."""

    name: str = ""
    batched: bool = False
    # the environment variable holding this source's credential, named when the backend rejects it (HTTP 401 / 403)
    secret_env: str = ""
    where: str = ""  # the backend's address for messages (never a credential)

    @abstractmethod
    async def search(self, http: httpx.AsyncClient, queries: list[str], topk: int, timeout_s: float) -> list[list[Doc]]:
        """One list of Docs per query, in order. Non-batched sources get exactly one query."""

    async def healthy(self, http: httpx.AsyncClient, timeout_s: float) -> bool:
        """Whether the backend answers its health check (the circuit breaker's probe). Sources without one say
        yes, so a paused search simply tries again."""
        return True

    async def documents(
        self, http: httpx.AsyncClient, ids: list[str], page: int, timeout_s: float
    ) -> list[DocumentPage]:
        """Page `page` of each whole document in `ids`, in order. A source without documents raises
        NotImplementedError (the client turns it into a `config` SearchError)."""
        raise NotImplementedError(f"search source {self.name!r} serves no documents")

    async def fingerprint(self, http: httpx.AsyncClient, timeout_s: float) -> str | None:
        """What identifies the index behind the source (a record / replay store is pinned to it); None for a source
        without one of its own (a web API)."""
        return None


def make_title_doc(doc_id: str, title: str, text: str, score: float, source: str) -> Doc:
    """A Doc in the corpus shape '"Title"\\ntext' (web sources write the same shape as the local corpus)."""
    title = " ".join(str(title or "").split())
    return Doc(id=str(doc_id), contents=f'"{title}"\n{str(text or "").strip()}', score=float(score), source=source)
