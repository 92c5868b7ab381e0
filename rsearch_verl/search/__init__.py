"""Search: the async client every trajectory calls, its cache, and the sources behind it.

from rsearch_verl.search import SearchClient, SearchError
client = SearchClient(cfg.retriever)            # sources: local (cfg.url), arxiv, web/news with $SERPER_API_KEY
docs = await client(["query"], topk=3, source="local")
"""

from rsearch_verl.search.client import SearchAuthError, SearchClient, SearchError, default_sources

__all__ = ["SearchAuthError", "SearchClient", "SearchError", "default_sources"]
