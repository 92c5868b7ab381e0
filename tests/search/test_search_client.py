"""SearchClient against a real local HTTP server (FastAPI + uvicorn on 127.0.0.1, a free port).

The fake server speaks the Search-R1 wire format and can be told to fail (500 / 400), to be slow, or to answer
without scores, so retries, backoff, timeouts, caching and coalescing are checked over real HTTP.
Run: .venv/bin/python -m pytest -q tests/search/test_search_client.py
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rsearch_verl.config import RetrieverConfig
from rsearch_verl.search import SearchClient, SearchError
from rsearch_verl.search.sources import LocalSource
from rsearch_verl.testing.servers import serve_in_thread


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fake_retriever(state: dict) -> FastAPI:
    app = FastAPI()

    @app.post("/retrieve")
    async def retrieve(request: Request):
        body = await request.json()
        state["posts"] += 1
        state["batch_sizes"].append(len(body["queries"]))
        if state["delay_s"]:
            await asyncio.sleep(state["delay_s"])
        if state["fail_500"] > 0:
            state["fail_500"] -= 1
            return JSONResponse({"detail": "boom"}, status_code=500)
        if state["status"] != 200:
            return JSONResponse({"detail": "bad request"}, status_code=state["status"])
        topk = body["topk"] or 3
        hits = [
            [{"id": f"{q}-{i}", "contents": f'"Title {q}"\ntext {i} about {q}'} for i in range(topk)]
            for q in body["queries"]
        ]
        if body.get("return_scores") and state["scores"]:
            hits = [[{"document": h, "score": 1.0 / (i + 1)} for i, h in enumerate(qh)] for qh in hits]
        return {"result": hits}

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, dict]]:
    state: dict = {}
    srv, thread, url = serve_in_thread(_fake_retriever(state))
    yield url, state
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture()
def url(server) -> str:
    base, state = server
    state.update(posts=0, batch_sizes=[], delay_s=0.0, fail_500=0, status=200, scores=True)
    return base


def _client(url: str, **cfg_kw) -> SearchClient:
    cfg = RetrieverConfig(url=url, **{"timeout_s": 2.0, "max_retries": 2, "cache": False, **cfg_kw})
    return SearchClient(cfg, backoff_s=0.01)


async def _call(client: SearchClient, *args, **kw):
    try:
        return await client(*args, **kw)
    finally:
        await client.aclose()


def test_both_wire_shapes_parse(url, server):
    state = server[1]
    for scores in (True, False):
        state["scores"] = scores
        docs = asyncio.run(_call(_client(url), ["q1", "q2"], 2))
        assert [[d.id for d in qd] for qd in docs] == [["q1-0", "q1-1"], ["q2-0", "q2-1"]]
        assert docs[0][0].title == "Title q1" and docs[0][0].text == "text 0 about q1"
        assert docs[0][0].score == (1.0 if scores else 0.0)


def test_retries_then_succeeds(url, server):
    server[1]["fail_500"] = 2
    client = _client(url)
    docs = asyncio.run(_call(client, ["q"], 1))
    assert docs[0][0].id == "q-0"
    m = client.metrics()
    assert m["search/retries"] == 2 and m["search/errors"] == 0 and m["search/requests"] == 3


def test_500_exhausts_retries_raises(url, server):
    server[1]["fail_500"] = 10
    client = _client(url, max_retries=2)
    with pytest.raises(SearchError) as info:
        asyncio.run(_call(client, ["q"], 1))
    assert info.value.kind == "http_500"
    assert server[1]["posts"] == 3  # 1 try + 2 retries, then give up
    assert client.metrics()["search/errors"] == 1


def test_4xx_is_not_retried(url, server):
    server[1]["status"] = 422
    client = _client(url)
    with pytest.raises(SearchError) as info:
        asyncio.run(_call(client, ["q"], 1))
    assert info.value.kind == "http_422"
    assert server[1]["posts"] == 1 and client.metrics()["search/retries"] == 0


def test_timeout_is_retried_then_raises(url, server):
    server[1]["delay_s"] = 0.5
    client = _client(url, timeout_s=0.1, max_retries=1)
    start = time.perf_counter()
    with pytest.raises(SearchError) as info:
        asyncio.run(_call(client, ["slow"], 1))
    assert info.value.kind == "timeout"
    assert time.perf_counter() - start < 2.0
    assert client.metrics()["search/retries"] == 1


def test_connection_refused_is_search_error():
    client = _client(f"http://127.0.0.1:{_free_port()}", max_retries=1)
    with pytest.raises(SearchError) as info:
        asyncio.run(_call(client, ["q"], 1))
    assert info.value.kind == "connection"


def test_cache_hit_skips_request(url, server):
    client = _client(url, cache=True)

    async def run():
        first = await client(["same"], 2)
        second = await client(["same"], 2)
        await client.aclose()
        return first, second

    first, second = asyncio.run(run())
    assert first == second and server[1]["posts"] == 1
    assert client.metrics()["search/cache_hits"] == 1


def test_concurrent_single_queries_are_coalesced(url, server):
    client = _client(url)
    queries = [f"q{i}" for i in range(20)]

    async def run():
        out = await asyncio.gather(*(client([q], 1) for q in queries))
        await client.aclose()
        return out

    results = asyncio.run(run())
    assert [r[0][0].id for r in results] == [f"{q}-0" for q in queries]  # each caller gets its own answer
    assert server[1]["posts"] < 5 and sum(server[1]["batch_sizes"]) == 20
    m = client.metrics()
    assert m["search/calls"] == 20 and m["search/queries"] == 20 and m["search/latency_p99"] > 0


def test_unknown_source_and_bad_args(url):
    client = _client(url)
    with pytest.raises(SearchError, match="unknown search source"):
        asyncio.run(_call(client, ["q"], 1, source="nope"))
    with pytest.raises(ValueError):
        LocalSource("")
    with pytest.raises(ValueError):
        SearchClient(RetrieverConfig(url=url, timeout_s=0))


def test_max_batch_splits_and_coalesce_off(url, server):
    state = server[1]
    client = SearchClient(RetrieverConfig(url=url, cache=False), max_batch=4)

    async def burst(c: SearchClient, n: int):
        out = await asyncio.gather(*(c([f"q{i}"], 1) for i in range(n)))
        return [r[0][0].id for r in out]

    assert asyncio.run(burst(client, 10)) == [f"q{i}-0" for i in range(10)]
    assert max(state["batch_sizes"]) <= 4 and state["posts"] == 3
    state.update(posts=0, batch_sizes=[])
    plain = SearchClient(RetrieverConfig(url=url, cache=False), coalesce=False)
    assert asyncio.run(burst(plain, 6)) == [f"q{i}-0" for i in range(6)]
    assert state["posts"] == 6


def test_client_survives_a_new_event_loop(url, server):
    """The agent loop may call asyncio.run per batch: the client rebinds its pool and semaphore to the new loop."""
    client = _client(url)
    assert asyncio.run(client(["a"], 1))[0][0].id == "a-0"
    assert asyncio.run(client(["b"], 1))[0][0].id == "b-0"
    assert client.metrics()["search/calls"] == 2

    async def closed_then_reused():
        await client.aclose()
        return await client(["c"], 1)  # same loop after aclose(): a fresh pool, not a crash

    assert asyncio.run(closed_then_reused())[0][0].id == "c-0"
    assert client.metrics(reset=True)["search/calls"] == 3
    assert client.metrics() == {**dict.fromkeys(client.metrics(), 0.0)}
