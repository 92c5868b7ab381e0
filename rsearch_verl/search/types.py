"""The retriever wing's types: `Doc` (one retrieved passage, whatever the source), `DocumentPage` (one page of a whole
document, `SearchClient.documents`) and `SearchFn` (the async search function a protocol's `observe` calls). Imported
by protocols, rewards, the search client and its sources."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass


class _CorpusText:
    """`title` / `text` of a `contents` in the corpus shape '"Title"\\ntext'."""

    contents: str

    @property
    def title(self) -> str:
        head = self.contents.split("\n", 1)[0]
        return head.strip().strip('"')

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) == 2 else parts[0]


@dataclass
class Doc(_CorpusText):
    """One retrieved passage, whatever the source (local index, web search, arXiv)."""

    id: str
    contents: str  # '"Title"\ntext' in the corpus format; web sources write the same shape
    score: float = 0.0
    source: str = "local"
    # the whole document's id when the passage is a part of one (an index built with `--chunk-tokens`: its passages
    # are `<doc id>#<k>`); None: the passage is its own document, `id` (what `SearchClient.documents` takes)
    doc_id: str | None = None


@dataclass
class DocumentPage(_CorpusText):
    """Page `page` (0-based) of the `pages` of a whole document (POST /documents of our retrieval server)."""

    id: str
    contents: str  # '"Title"\n<the page's text>': the pages' texts put back together are the document's text
    page: int
    pages: int


# search(queries, topk, source) -> one list of Docs per query; raises rsearch_verl.search.client.SearchError
SearchFn = Callable[[list[str], int, str], Awaitable[list[list[Doc]]]]
