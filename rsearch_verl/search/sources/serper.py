"""Serper-style Google web / news search: `POST {base_url}/search` (or `/news`) with an `X-API-KEY` header.

Request `{"q": query, "num": k}`; the answer's `organic` list (web) or `news` list (news) becomes Docs
`'"title"\\nsnippet'` with the link as id. The key comes from the argument or `$SERPER_API_KEY`;
`base_url` is configurable so tests point it at a local fake server.
"""

from __future__ import annotations

import os

import httpx

from rsearch_verl.search.sources.base import Source, SourceResponseError, make_title_doc
from rsearch_verl.search.types import Doc

SERPER_URL = "https://google.serper.dev"


class SerperSource(Source):
    """One query per request (the API takes one `q`); `kind` is "search" (web) or "news"."""

    batched = False
    secret_env = "SERPER_API_KEY"

    def __init__(self, api_key: str | None = None, kind: str = "search", base_url: str = SERPER_URL):
        if kind not in ("search", "news"):
            raise ValueError(f"SerperSource kind must be 'search' or 'news', got {kind!r}")
        self.api_key = api_key if api_key is not None else os.environ.get("SERPER_API_KEY", "")
        if not self.api_key:
            raise ValueError("SerperSource needs an API key (argument or $SERPER_API_KEY)")
        self.kind = kind
        self.name = "web" if kind == "search" else "news"
        self.base_url = base_url.rstrip("/")
        self.where = self.base_url

    async def search(self, http: httpx.AsyncClient, queries: list[str], topk: int, timeout_s: float) -> list[list[Doc]]:
        if len(queries) != 1:
            raise ValueError("SerperSource takes one query per request")
        resp = await http.post(
            f"{self.base_url}/{self.kind}",
            json={"q": queries[0], "num": int(topk)},
            headers={"X-API-KEY": self.api_key},
            timeout=timeout_s,
        )
        resp.raise_for_status()
        try:
            body = resp.json()
        except ValueError as exc:
            raise SourceResponseError(f"serper answer is not JSON: {resp.text[:80]!r}") from exc
        key = "organic" if self.kind == "search" else "news"
        items = body.get(key, []) if isinstance(body, dict) else None
        if not isinstance(items, list):
            raise SourceResponseError(f"serper answer has no '{key}' list")
        docs = [
            make_title_doc(it.get("link", f"{self.name}-{i}"), it.get("title"), it.get("snippet"), 0.0, self.name)
            for i, it in enumerate(items[:topk])
            if isinstance(it, dict)
        ]
        return [docs]
