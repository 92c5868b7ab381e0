"""Our retrieval server, or any Search-R1-compatible one: `POST {url}/retrieve`.

Request `{"queries": [...], "topk": k, "return_scores": true}`; both wire shapes of the answer are parsed:
`{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}` (scores) and
`{"result": [[{"id", "contents"}, ...], ...]}` (no scores). Documents written as `{"title", "text"}` are accepted too.
A bearer token (argument or `$RETRIEVER_TOKEN`) is sent when set.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from rsearch_verl.search.sources.base import Source, SourceResponseError, make_title_doc
from rsearch_verl.search.types import Doc


def _parse_hit(hit: Any, rank: int) -> Doc:
    if not isinstance(hit, dict):
        raise SourceResponseError(f"retrieval hit is not an object: {str(hit)[:80]!r}")
    doc = hit.get("document", hit)
    score = float(hit.get("score", 0.0) or 0.0)
    if not isinstance(doc, dict):
        raise SourceResponseError(f"retrieval document is not an object: {str(doc)[:80]!r}")
    doc_id = str(doc.get("id", rank))
    if "contents" in doc:
        return Doc(id=doc_id, contents=str(doc["contents"]), score=score, source="local")
    if "text" in doc:
        return make_title_doc(doc_id, doc.get("title", ""), doc["text"], score, "local")
    raise SourceResponseError(f"retrieval document has neither 'contents' nor 'text': keys {sorted(doc)}")


def parse_retrieve_response(body: Any, n_queries: int) -> list[list[Doc]]:
    """Parse a /retrieve answer (either wire shape) into one Doc list per query."""
    if not isinstance(body, dict) or not isinstance(body.get("result"), list):
        raise SourceResponseError("retrieval answer has no 'result' list")
    result = body["result"]
    if len(result) != n_queries:
        raise SourceResponseError(f"retrieval answer has {len(result)} result lists for {n_queries} queries")
    out: list[list[Doc]] = []
    for hits in result:
        if not isinstance(hits, list):
            raise SourceResponseError("retrieval result entry is not a list")
        out.append([_parse_hit(hit, rank) for rank, hit in enumerate(hits)])
    return out


class LocalSource(Source):
    """A retrieval server speaking the Search-R1 wire format (ours: `python -m retrieval_server serve`)."""

    name = "local"
    batched = True
    secret_env = "RETRIEVER_TOKEN"

    def __init__(self, url: str, token: str | None = None):
        if not url:
            raise ValueError("LocalSource needs the retrieval server URL (retriever.url)")
        self.url = url.rstrip("/")
        self.where = f"retriever.url={self.url}"
        # our server's optional bearer token (retrieval_server's ServerConfig.token / $RETRIEVER_TOKEN)
        token = token if token is not None else os.environ.get("RETRIEVER_TOKEN")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def search(self, http: httpx.AsyncClient, queries: list[str], topk: int, timeout_s: float) -> list[list[Doc]]:
        payload = {"queries": list(queries), "topk": int(topk), "return_scores": True}
        resp = await http.post(f"{self.url}/retrieve", json=payload, headers=self.headers, timeout=timeout_s)
        resp.raise_for_status()
        try:
            body = resp.json()
        except ValueError as exc:
            raise SourceResponseError(f"retrieval answer is not JSON: {resp.text[:80]!r}") from exc
        return parse_retrieve_response(body, len(queries))

    async def healthy(self, http: httpx.AsyncClient, timeout_s: float) -> bool:
        try:
            resp = await http.get(f"{self.url}/health", headers=self.headers, timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200
