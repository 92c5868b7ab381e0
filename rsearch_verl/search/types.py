"""The retriever wing's types: `Doc` (one retrieved passage, whatever the source) and `SearchFn` (the async search
function a protocol's `observe` calls). Imported by protocols, rewards, the search client and its sources."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass
class Doc:
    """One retrieved passage, whatever the source (local index, web search, arXiv)."""

    id: str
    contents: str  # '"Title"\ntext' in the corpus format; web sources write the same shape
    score: float = 0.0
    source: str = "local"

    @property
    def title(self) -> str:
        head = self.contents.split("\n", 1)[0]
        return head.strip().strip('"')

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) == 2 else parts[0]


# search(queries, topk, source) -> one list of Docs per query; raises rsearch_verl.search.client.SearchError
SearchFn = Callable[[list[str], int, str], Awaitable[list[list[Doc]]]]
