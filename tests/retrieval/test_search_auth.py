"""A rejected credential stops the run: HTTP 401 / 403 is neither an error observation nor an outage.

Against a real `python -m retrieval_server serve --token test-token` (the `token_server` fixture): a client with a
wrong or missing token raises `SearchAuthError` naming RETRIEVER_TOKEN at once (no retries, not counted as a search
error), the circuit breaker passes it through without opening, the Search-R1 protocol does not turn it into an
observation, and the preflight check rejects the token before any start-up work. Serper's 403 takes the same path.
Run: .venv/bin/python -m pytest -q tests/retrieval/test_search_auth.py
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rsearch_verl.config import BreakerConfig, RetrieverConfig
from rsearch_verl.rollout.protocols import get_protocol
from rsearch_verl.search import SearchAuthError, SearchClient, SearchError
from rsearch_verl.search.breaker import CircuitBreaker
from rsearch_verl.search.sources import LocalSource, SerperSource
from rsearch_verl.trainer.preflight import PreflightError, check_retriever_token, wait_for_retriever

TOKEN = "test-token"  # the token_server fixture's --token


def _client(url: str, token: str | None) -> SearchClient:
    cfg = RetrieverConfig(url=url, max_retries=3, timeout_s=10.0)
    return SearchClient(cfg, {"local": LocalSource(url, token=token)}, backoff_s=0.01)


async def _search(client, query: str = "who wrote hamlet"):
    try:
        return await client([query], 2, "local")
    finally:
        await client.aclose()


def test_wrong_token_raises_auth_error_without_retries(token_server, monkeypatch):
    monkeypatch.setenv("RETRIEVER_TOKEN", "wrong-token")
    client = _client(token_server.url, "wrong-token")
    with pytest.raises(SearchAuthError, match="RETRIEVER_TOKEN was rejected") as info:
        asyncio.run(_search(client))
    err = info.value
    assert not isinstance(err, SearchError)  # so no protocol catches it as an observation
    assert err.variable == "RETRIEVER_TOKEN" and "HTTP 401" in str(err) and "wrong-token" not in str(err)
    assert f"retriever.url={token_server.url}" in str(err)
    metrics = client.metrics()
    assert metrics["search/requests"] == 1 and metrics["search/retries"] == 0 and metrics["search/errors"] == 0


def test_missing_token_names_the_variable(token_server, monkeypatch):
    monkeypatch.delenv("RETRIEVER_TOKEN", raising=False)
    with pytest.raises(SearchAuthError, match="RETRIEVER_TOKEN is not set in the rollout worker"):
        asyncio.run(_search(_client(token_server.url, "")))


def test_right_token_searches(token_server):
    docs = asyncio.run(_search(_client(token_server.url, TOKEN)))
    assert len(docs) == 1 and len(docs[0]) == 2


def test_breaker_and_protocol_pass_it_through(token_server):
    """The breaker records no outcome (no trip, no wait) and the protocol returns no observation."""
    breaker = CircuitBreaker(_client(token_server.url, "wrong-token"), BreakerConfig(min_calls=1, failure_rate=0.1))
    proto = get_protocol("search_r1")
    action = proto.parse_turn("<search>who wrote hamlet</search>")

    async def run():
        with pytest.raises(SearchAuthError):
            await breaker(["q"], 2, "local")
        with pytest.raises(SearchAuthError):
            await proto.observe(action, breaker, 2)
        await breaker.search.aclose()

    asyncio.run(run())
    assert breaker.opened_at is None and len(breaker._outcomes) == 0
    assert breaker.metrics()["search/breaker_trips"] == 0


def test_preflight_checks_the_token(token_server):
    health = wait_for_retriever(token_server.url, 5.0)
    assert health["auth"] is True
    with pytest.raises(PreflightError, match="rejected RETRIEVER_TOKEN"):
        check_retriever_token(token_server.url, health, "wrong-token")
    with pytest.raises(PreflightError, match="RETRIEVER_TOKEN is not set"):
        check_retriever_token(token_server.url, health, None)
    check_retriever_token(token_server.url, health, TOKEN)


def test_serper_403_names_its_key(monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", "bad-key")
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(403, json={"message": "Unauthorized."})

    client = SearchClient(RetrieverConfig(max_retries=3), {"web": SerperSource(base_url="http://serper.test")})

    async def run():
        client._bind_loop()  # then swap in a transport that answers like Serper with a bad key
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        try:
            await client(["llm agents"], 2, "web")
        finally:
            await client.aclose()

    with pytest.raises(SearchAuthError, match="SERPER_API_KEY was rejected") as info:
        asyncio.run(run())
    assert "bad-key" not in str(info.value) and seen == ["/search"]
