"""Search sources (Serper-style web/news, arXiv Atom, local retrieval server) against LOCAL fake HTTP servers.

One FastAPI app on 127.0.0.1 plays Serper (`POST /search`, `/news`, X-API-KEY), arXiv (`GET /api/query`, Atom
XML) and a Search-R1 retriever (`POST /retrieve`, bearer token); every source is used through SearchClient,
so nothing leaves the machine and the whole path (routing, parsing, errors) is real HTTP.
Run: .venv/bin/python -m pytest -q tests/search/test_search_sources.py
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response

from retrieval_server.app import create_app
from retrieval_server.config import ServerConfig
from rsearch_verl.config import RetrieverConfig
from rsearch_verl.rollout.protocols import get_protocol
from rsearch_verl.search import SearchAuthError, SearchClient, SearchError, default_sources
from rsearch_verl.search.sources import ArxivSource, LocalSource, SerperSource
from rsearch_verl.search.sources.arxiv import parse_atom
from rsearch_verl.testing.searchr1_server import create_baseline_app
from rsearch_verl.testing.servers import serve_in_thread

KEY = "test-key"
ATOM = """<?xml version="1.0" encoding="UTF-8"?>
<feed xmlns="http://www.w3.org/2005/Atom">
  <title>ArXiv Query</title>
  {entries}
</feed>"""
ENTRY = """<entry><id>http://arxiv.org/abs/2503.0{i}v1</id><title>Paper {i} on
  {q}</title><summary>  Abstract {i}
  about {q}. </summary><author><name>A. Author</name></author></entry>"""


class WordOverlapRetriever:
    """A tiny real retriever for our server's `create_app`: score = number of shared lower-case words."""

    corpus = [
        {"id": str(i), "contents": f'"{t}"\n{x}'}
        for i, (t, x) in enumerate(
            [
                ("Hamlet", "Hamlet is a tragedy by William Shakespeare."),
                ("Paris", "Paris is the capital of France."),
                ("Citibank", "Citibank was founded in 1812."),
                ("Madison", "James Madison was president in 1812."),
            ]
        )
    ]
    n_docs = len(corpus)
    info = {"encoder": "word-overlap", "index_type": "none"}

    def search(self, queries: list[str], k: int) -> tuple[list[list[int]], list[list[float]]]:
        rows, scores = [], []
        for q in queries:
            words = set(q.lower().split())
            scored = sorted(((len(words & set(d["contents"].lower().split())), -i) for i, d in enumerate(self.corpus)))
            top = scored[::-1][:k]
            rows.append([-i for _, i in top])
            scores.append([float(s) for s, _ in top])
        return rows, scores

    def docs(self, ids: list[int]) -> list[dict]:
        return [dict(self.corpus[i]) for i in ids]


def _serve(app: FastAPI) -> tuple[uvicorn.Server, threading.Thread, str]:
    return serve_in_thread(app)


@pytest.mark.parametrize("make_app", [create_app, create_baseline_app], ids=["batched", "searchr1"])
def test_local_source_against_our_retrieval_server(make_app):
    """Wire compatibility with retrieval_server.create_app and the Search-R1-like baseline, token and 4xx included."""
    app = make_app(ServerConfig(token="secret", max_topk=3), WordOverlapRetriever())
    srv, thread, url = _serve(app)
    try:
        cfg = RetrieverConfig(url=url, timeout_s=5.0, max_retries=2, cache=False)
        client = SearchClient(cfg, {"local": LocalSource(url, token="secret")}, backoff_s=0.01)

        async def go():
            many = await asyncio.gather(client(["who wrote hamlet"], 2), client(["citibank founded"], 2))
            with pytest.raises(SearchError) as info:
                await client(["q"], 50)  # over the server's max_topk: 422, a client error, not retried
            await client.aclose()
            return many, info.value

        (hamlet, citi), err = asyncio.run(go())
        assert hamlet[0][0].title == "Hamlet" and hamlet[0][0].score == 1.0 and len(hamlet[0]) == 2
        assert citi[0][0].text == "Citibank was founded in 1812."
        assert err.kind == "http_422" and client.metrics()["search/retries"] == 0
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def _fake_apis(state: dict) -> FastAPI:
    app = FastAPI()

    @app.post("/{kind}")
    async def serper(kind: str, request: Request, x_api_key: str = Header(default="")):
        body = await request.json()
        state["serper"].append((kind, body, x_api_key))
        if x_api_key != KEY:
            return JSONResponse({"message": "Unauthorized."}, status_code=401)
        if body["q"] == "malformed":
            return JSONResponse([1, 2])  # not an object: unparseable
        items = [{"title": f"{kind} {i} {body['q']}", "link": f"https://x/{i}", "snippet": f"s{i}"} for i in range(9)]
        return {"organic": items} if kind == "search" else {"news": [{**it, "date": "1 day ago"} for it in items]}

    @app.get("/api/query")
    async def arxiv(search_query: str, start: int = 0, max_results: int = 10):
        state["arxiv"].append((search_query, start, max_results))
        q = search_query.removeprefix("all:")
        if q == "broken":
            return Response("<feed><entry>", media_type="application/atom+xml")
        entries = "".join(ENTRY.format(i=i, q=q) for i in range(max_results))
        return Response(ATOM.format(entries=entries), media_type="application/atom+xml")

    @app.post("/rag/retrieve")
    async def retrieve(request: Request, authorization: str = Header(default="")):
        if authorization != "Bearer secret":
            return JSONResponse({"detail": "bad token"}, status_code=401)
        body = await request.json()
        return {"result": [[{"title": f"T {q}", "text": f"body {q}"}] for q in body["queries"]]}

    return app


@pytest.fixture(scope="module")
def base() -> Iterator[tuple[str, dict]]:
    state: dict = {"serper": [], "arxiv": []}
    srv, thread, url = serve_in_thread(_fake_apis(state))
    yield url, state
    srv.should_exit = True
    thread.join(timeout=10)


def _client(url: str) -> SearchClient:
    sources = {
        "web": SerperSource(api_key=KEY, base_url=url),
        "news": SerperSource(api_key=KEY, kind="news", base_url=url),
        "arxiv": ArxivSource(base_url=url),
        "local": LocalSource(f"{url}/rag", token="secret"),
    }
    return SearchClient(RetrieverConfig(url=None, timeout_s=5.0, max_retries=1, cache=False), sources, backoff_s=0.01)


def _run(coro_fn):
    return asyncio.run(coro_fn())


def test_serper_web_and_news(base):
    url, state = base
    client = _client(url)

    async def go():
        web = await client(["llm search", "ray"], 3, source="web")
        news = await client(["coke price"], 2, source="news")
        await client.aclose()
        return web, news

    web, news = _run(go)
    assert [len(r) for r in web] == [3, 3] and len(news[0]) == 2
    assert web[0][0].contents == '"search 0 llm search"\ns0' and web[0][0].id == "https://x/0"
    assert web[1][2].title == "search 2 ray" and web[0][0].source == "web"
    assert news[0][1].title == "news 1 coke price" and news[0][1].source == "news"
    kinds = sorted((k, b["q"], b["num"], key) for k, b, key in state["serper"][-3:])
    assert kinds == [("news", "coke price", 2, KEY), ("search", "llm search", 3, KEY), ("search", "ray", 3, KEY)]


def test_serper_errors(base):
    url, state = base
    bad_key = SearchClient(RetrieverConfig(timeout_s=5.0, max_retries=3), {"web": SerperSource("nope", base_url=url)})
    n = len(state["serper"])
    with pytest.raises(SearchAuthError, match="SERPER_API_KEY") as info:  # a rejected key stops the run
        asyncio.run(bad_key(["q"], 1, source="web"))
    assert not isinstance(info.value, SearchError) and len(state["serper"]) == n + 1  # not retried
    with pytest.raises(SearchError) as info:
        asyncio.run(_client(url)(["malformed"], 1, source="web"))
    assert info.value.kind == "bad_response"
    with pytest.raises(ValueError):
        SerperSource(api_key="k", kind="images")


def test_arxiv_atom(base):
    url, state = base
    docs = asyncio.run(_client(url)(["retrieval augmented generation"], 2, source="arxiv"))[0]
    assert state["arxiv"][-1] == ("all:retrieval augmented generation", 0, 2)
    assert [d.id for d in docs] == ["http://arxiv.org/abs/2503.00v1", "http://arxiv.org/abs/2503.01v1"]
    assert docs[1].title == "Paper 1 on retrieval augmented generation"
    assert docs[1].text == "Abstract 1 about retrieval augmented generation." and docs[1].source == "arxiv"
    with pytest.raises(SearchError) as info:
        asyncio.run(_client(url)(["broken"], 2, source="arxiv"))
    assert info.value.kind == "bad_response"
    assert parse_atom(ATOM.format(entries=""), 5) == []


def test_local_source_title_text_shape_and_token(base):
    url, _ = base
    docs = asyncio.run(_client(url)(["a", "b"], 1, source="local"))
    assert [d[0].contents for d in docs] == ['"T a"\nbody a', '"T b"\nbody b']
    no_token = SearchClient(RetrieverConfig(timeout_s=5.0), {"local": LocalSource(f"{url}/rag", token="")})
    with pytest.raises(SearchAuthError, match="RETRIEVER_TOKEN"):
        asyncio.run(no_token(["a"], 1))


def test_nl_dag_plan_across_sources(base):
    """An NL-DAG mixing tools runs each node on its own source, through one client, over real HTTP."""
    url, _ = base
    client = _client(url)
    proto = get_protocol("nl_dag", tools={"Wiki": "local", "Web": "web", "ArXiv": "arxiv"})
    action = proto.parse_turn("<search>Nodes: A: a (Wiki)\nB: agents (ArXiv)\nC: c (Web)\nEdges: A -> C</search>")

    async def go():
        obs = await proto.observe(action, client, 1)
        await client.aclose()
        return obs

    obs = _run(go)
    assert "Node A (Wiki) Search results:\nResult 1:\nTitle: T a\nAbstract: body a" in obs
    assert "Node B (ArXiv) Search results:\nResult 1:\nTitle: Paper 0 on agents" in obs
    assert "Node C (Web) Search results:\nResult 1:\nTitle: search 0 c\nAbstract: s0" in obs
    assert client.metrics()["search/calls"] == 3


def test_default_sources(monkeypatch):
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    assert sorted(default_sources(RetrieverConfig(url="http://127.0.0.1:1"))) == ["arxiv", "local"]
    monkeypatch.setenv("SERPER_API_KEY", "k")
    assert sorted(default_sources(RetrieverConfig(url=None))) == ["arxiv", "news", "web"]


def test_retriever_token_from_the_config_else_the_variable(monkeypatch):
    monkeypatch.setenv("RETRIEVER_TOKEN", "from-env")
    configured = default_sources(RetrieverConfig(url="http://127.0.0.1:9", token="from-config"))["local"]
    assert configured.headers == {"Authorization": "Bearer from-config"}
    assert default_sources(RetrieverConfig(url="http://127.0.0.1:9"))["local"].headers == {
        "Authorization": "Bearer from-env"
    }
