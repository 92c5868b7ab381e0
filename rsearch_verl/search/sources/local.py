"""Our retrieval server, or any Search-R1-compatible one: `POST {url}/retrieve`, and our `POST {url}/documents`.

Request `{"queries": [...], "topk": k, "return_scores": true}`; both wire shapes of the answer are parsed:
`{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}` (scores) and
`{"result": [[{"id", "contents"}, ...], ...]}` (no scores). Documents written as `{"title", "text"}` are accepted too;
a chunked index's passages also carry their document's `doc_id` (kept on the Doc).
`POST /documents {"ids": [...], "page": p}` -> `{"result": [{"id", "contents", "page", "pages"}, ...]}` (DocumentPage).
A bearer token (argument or `$RETRIEVER_TOKEN`) is sent when set.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import httpx

from rsearch_verl.search.sources.base import Source, SourceResponseError, make_title_doc
from rsearch_verl.search.types import Doc, DocumentPage

logger = logging.getLogger(__name__)


def _parse_hit(hit: Any, rank: int) -> Doc:
    if not isinstance(hit, dict):
        raise SourceResponseError(f"retrieval hit is not an object: {str(hit)[:80]!r}")
    doc = hit.get("document", hit)
    score = float(hit.get("score", 0.0) or 0.0)
    if not isinstance(doc, dict):
        raise SourceResponseError(f"retrieval document is not an object: {str(doc)[:80]!r}")
    doc_id = str(doc.get("id", rank))
    if "contents" in doc:
        parsed = Doc(id=doc_id, contents=str(doc["contents"]), score=score, source="local")
    elif "text" in doc:
        parsed = make_title_doc(doc_id, doc.get("title", ""), doc["text"], score, "local")
    else:
        raise SourceResponseError(f"retrieval document has neither 'contents' nor 'text': keys {sorted(doc)}")
    if doc.get("doc_id") is not None:  # a passage of a chunked index: the document it is part of
        parsed.doc_id = str(doc["doc_id"])
    return parsed


def parse_documents_response(body: Any, ids: list[str]) -> list[DocumentPage]:
    """Parse a /documents answer into one DocumentPage per requested id, in order."""
    if not isinstance(body, dict) or not isinstance(body.get("result"), list):
        raise SourceResponseError("documents answer has no 'result' list")
    result = body["result"]
    if len(result) != len(ids):
        raise SourceResponseError(f"documents answer has {len(result)} documents for {len(ids)} ids")
    out = []
    for doc_id, item in zip(ids, result, strict=True):
        if not isinstance(item, dict) or item.get("id") != doc_id:
            raise SourceResponseError(f"documents answer for {doc_id!r} is not its document: {str(item)[:80]!r}")
        page, pages, contents = item.get("page"), item.get("pages"), item.get("contents")
        if not isinstance(contents, str) or not isinstance(page, int) or not isinstance(pages, int):
            raise SourceResponseError(f"documents answer for {doc_id!r} lacks contents / page / pages")
        out.append(DocumentPage(id=doc_id, contents=contents, page=page, pages=pages))
    return out


def health_fingerprint(health: dict) -> str:
    """The index fingerprint a retrieval server's GET /health reports (ours: retrieval_server/fingerprint.py). A server
    that reports none (another Search-R1-compatible one, or ours before fingerprints) gets one made of what it does
    say about its index, `described:...` (weaker: two indexes of one size and encoder look alike), or `unknown`."""
    if health.get("fingerprint"):
        return str(health["fingerprint"])
    said = {k: health[k] for k in ("encoder", "index_type", "n_docs", "dim") if health.get(k) is not None}
    if not said:
        logger.warning(
            "the retrieval server reports no index fingerprint: a record/replay store is pinned to 'unknown'"
        )
        return "unknown"
    return "described:" + ",".join(f"{k}={v}" for k, v in sorted(said.items()))


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
        return parse_retrieve_response(_json(resp, "retrieval answer"), len(queries))

    async def fingerprint(self, http: httpx.AsyncClient, timeout_s: float) -> str:
        """The index's fingerprint from GET /health (a server without /health: `health_fingerprint({})`)."""
        resp = await http.get(f"{self.url}/health", headers=self.headers, timeout=timeout_s)
        if resp.status_code == 404:
            return health_fingerprint({})
        resp.raise_for_status()
        body = _json(resp, "retrieval /health answer")
        return health_fingerprint(body if isinstance(body, dict) else {})

    async def documents(
        self, http: httpx.AsyncClient, ids: list[str], page: int, timeout_s: float
    ) -> list[DocumentPage]:
        payload = {"ids": list(ids), "page": int(page)}
        resp = await http.post(f"{self.url}/documents", json=payload, headers=self.headers, timeout=timeout_s)
        resp.raise_for_status()
        return parse_documents_response(_json(resp, "documents answer"), list(ids))

    async def healthy(self, http: httpx.AsyncClient, timeout_s: float) -> bool:
        try:
            resp = await http.get(f"{self.url}/health", headers=self.headers, timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200


def _json(resp: httpx.Response, what: str):
    """The response's JSON body; SourceResponseError naming `what` when it is not JSON."""
    try:
        return resp.json()
    except ValueError as exc:
        raise SourceResponseError(f"{what} is not JSON: {resp.text[:80]!r}") from exc
