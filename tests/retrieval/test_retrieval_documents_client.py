"""`SearchClient.documents(ids, page)`: against a real `python -m retrieval_server serve` of a chunked index (pages,
404 for an unknown id, 422 past the end, the token, `Doc.doc_id` on searches), and against a fake /documents served by
uvicorn in a thread for what a real server will not do on demand: 5xx then success (retried), slowness (timeout),
a broken answer, 401.
Run: .venv/bin/python -m pytest -q tests/retrieval/test_retrieval_documents_client.py
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from conftest import DOCS_TOKEN, PAGE_TOKENS
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rsearch_verl.config import RetrieverConfig
from rsearch_verl.search import SearchClient, SearchError
from rsearch_verl.search.client import SearchAuthError
from rsearch_verl.search.types import DocumentPage
from rsearch_verl.testing.servers import serve_in_thread


def _client(url: str, token: str | None = DOCS_TOKEN, **cfg_kw) -> SearchClient:
    cfg = RetrieverConfig(url=url, token=token, **{"timeout_s": 5.0, "max_retries": 2, "cache": False, **cfg_kw})
    return SearchClient(cfg, backoff_s=0.01)


def _run(client: SearchClient, coro_fn):
    async def go():
        try:
            return await coro_fn(client)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_documents_pages_and_errors_from_a_served_index(chunked_server, documents_corpus):
    client = _client(chunked_server.url)
    pages = _run(client, lambda c: c.documents(["atlas", "short"], page=0))
    assert [type(p) for p in pages] == [DocumentPage, DocumentPage]
    assert [(p.id, p.page) for p in pages] == [("atlas", 0), ("short", 0)]
    assert pages[0].pages == 8 and pages[0].title == "Atlas" and len(pages[0].text.split()) == PAGE_TOKENS
    assert pages[1].contents == documents_corpus[1]["short"] and pages[1].pages == 1
    last = _run(client, lambda c: c.documents(["atlas"], 7))[0]
    assert last.page == 7 and last.text.endswith("\n")

    with pytest.raises(SearchError) as unknown:
        _run(client, lambda c: c.documents(["atlas", "no-such-doc"]))
    assert unknown.value.kind == "http_404" and "no-such-doc" in unknown.value.message
    assert not unknown.value.outage  # the request's fault: the breaker does not count it
    with pytest.raises(SearchError) as past:
        _run(client, lambda c: c.documents(["atlas"], page=8))
    assert past.value.kind == "http_422" and "8 pages" in past.value.message
    m = client.document_metrics()
    assert m["documents/calls"] == 4 and m["documents/errors"] == 2 and m["documents/retries"] == 0
    assert client.metrics()["search/calls"] == 0  # searches' metrics untouched


def test_search_docs_carry_their_document_id(chunked_server, unchunked_server):
    chunked = _run(_client(chunked_server.url), lambda c: c(["zeppelin marmalade"], 1))[0][0]
    assert chunked.doc_id == "borealis" and chunked.id.startswith("borealis#")
    plain = _run(_client(unchunked_server.url, token=None), lambda c: c(["zeppelin marmalade"], 1))[0][0]
    assert plain.id == "borealis" and plain.doc_id is None  # unchunked: the passage is the document


def test_documents_wrong_token_and_bad_arguments(chunked_server):
    with pytest.raises(SearchAuthError) as auth:
        _run(_client(chunked_server.url, token="wrong"), lambda c: c.documents(["atlas"]))
    assert auth.value.variable == "RETRIEVER_TOKEN"
    with pytest.raises(ValueError):
        _run(_client(chunked_server.url), lambda c: c.documents([]))
    with pytest.raises(ValueError):
        _run(_client(chunked_server.url), lambda c: c.documents(["atlas"], page=-1))
    with pytest.raises(SearchError) as no_docs:  # a web source has no documents: no request is made
        _run(_client(chunked_server.url), lambda c: c.documents(["x"], source="arxiv"))
    assert no_docs.value.kind == "config"


# ---- a fake /documents for failures on demand ------------------------------------------------------------------
def _fake_documents(state: dict) -> FastAPI:
    app = FastAPI()

    @app.post("/documents")
    async def documents(request: Request):
        body = await request.json()
        state["posts"] += 1
        if state["delay_s"]:
            await asyncio.sleep(state["delay_s"])
        if state["fail"] > 0:
            state["fail"] -= 1
            return JSONResponse({"detail": "boom"}, status_code=state["status"])
        if state["broken"]:
            return {"result": [{"id": "someone else", "contents": "", "page": 0, "pages": 1}]}
        return {
            "result": [
                {"id": i, "contents": f'"T"\npage of {i}', "page": body["page"], "pages": 3} for i in body["ids"]
            ]
        }

    return app


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, dict]]:
    state: dict = {}
    srv, thread, url = serve_in_thread(_fake_documents(state))
    yield url, state
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture()
def fake_url(fake) -> str:
    url, state = fake
    state.update(posts=0, delay_s=0.0, fail=0, status=500, broken=False)
    return url


def test_documents_retries_5xx_then_succeeds(fake_url, fake):
    fake[1]["fail"] = 2
    client = _client(fake_url, token=None)
    pages = _run(client, lambda c: c.documents(["a", "b"], 2))
    assert [(p.id, p.page, p.pages, p.text) for p in pages] == [("a", 2, 3, "page of a"), ("b", 2, 3, "page of b")]
    assert fake[1]["posts"] == 3 and client.document_metrics()["documents/retries"] == 2


def test_documents_gives_up_after_bounded_retries(fake_url, fake):
    fake[1]["fail"] = 10
    client = _client(fake_url, token=None)
    with pytest.raises(SearchError) as err:
        _run(client, lambda c: c.documents(["a"]))
    assert err.value.kind == "http_500" and err.value.outage and fake[1]["posts"] == 3  # 1 + max_retries
    assert client.document_metrics()["documents/errors"] == 1


def test_documents_timeout_and_broken_answer(fake_url, fake):
    fake[1]["delay_s"] = 1.0
    with pytest.raises(SearchError) as slow:
        _run(_client(fake_url, token=None, timeout_s=0.2, max_retries=1), lambda c: c.documents(["a"]))
    assert slow.value.kind == "timeout" and fake[1]["posts"] == 2
    fake[1].update(delay_s=0.0, broken=True)
    with pytest.raises(SearchError) as broken:
        _run(_client(fake_url, token=None), lambda c: c.documents(["a"]))
    assert broken.value.kind == "bad_response"  # not retried: the answer, not the connection, is wrong
    fake[1].update(broken=False, fail=1, status=401)
    with pytest.raises(SearchAuthError):
        _run(_client(fake_url, token=None), lambda c: c.documents(["a"]))
