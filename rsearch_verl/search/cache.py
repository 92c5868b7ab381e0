"""A small LRU cache of search results keyed by (source, topk, query).

    cache = SearchCache(maxsize=100_000)
    cache.get(("local", 3, "who wrote hamlet"))  # -> list[Doc] | None
    cache.put(key, docs)

Used by `SearchClient` when `retriever.cache` is true: GRPO samples n responses per prompt and they often
issue the same first query, so a cache saves a large share of retrieval calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from rsearch_verl.search.types import Doc


class SearchCache:
    """Least-recently-used map from a hashable key to a Doc list (not thread-safe; one event loop uses it)."""

    def __init__(self, maxsize: int = 100_000):
        if maxsize <= 0:
            raise ValueError(f"cache maxsize must be positive, got {maxsize}")
        self.maxsize = maxsize
        self._data: OrderedDict[Hashable, list[Doc]] = OrderedDict()

    def get(self, key: Hashable) -> list[Doc] | None:
        docs = self._data.get(key)
        if docs is not None:
            self._data.move_to_end(key)
        return docs

    def put(self, key: Hashable, docs: list[Doc]) -> None:
        self._data[key] = docs
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)
