"""The search circuit breaker in the real agent loop (HF engine, scripted to search) against a real HTTP retriever
(FastAPI + uvicorn on 127.0.0.1) that can be switched between answering, failing with 503 and being slow:

- an outage pauses the rollout: once the retriever answers again every search gets real passages, no trajectory sees
  an error observation, and the pause is counted;
- a retriever slower than the client timeout: each search is retried a bounded number of times (counted), the breaker
  waits, and at `retriever.breaker.deadline_s` the rollout stops with `RetrieverDownError` in bounded time;
- with the breaker off, failures become error observations (the old behaviour) and the trajectories are marked
  `search_failed`, which is what the trainer drops from the update.

Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_breaker.py
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from conftest import scripted_hf
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rsearch_verl.config import RSearchConfig
from rsearch_verl.data.dataset import PromptDataset
from rsearch_verl.rollout.agent_loop import generate_batch
from rsearch_verl.rollout.protocols import protocol_for
from rsearch_verl.search.breaker import RetrieverDownError
from rsearch_verl.search.process import process_search_client
from rsearch_verl.testing.servers import serve_in_thread


def _switchable_app(state: dict) -> FastAPI:
    """mode "ok" | "slow" (2 s per /retrieve, /health fine) | "outage" (503 everywhere for `outage_s` from the first
    request that meets it, then "ok")."""
    app = FastAPI()

    def down() -> bool:
        if state["mode"] != "outage":
            return False
        state["down_since"] = state.get("down_since") or time.monotonic()
        if time.monotonic() - state["down_since"] < state["outage_s"]:
            return True
        state["mode"] = "ok"
        return False

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"}, status_code=503 if down() else 200)

    @app.post("/retrieve")
    async def retrieve(request: Request):
        body = await request.json()
        state["posts"] += 1
        state["first_post"] = state.get("first_post") or time.monotonic()
        if down():
            return JSONResponse({"detail": "down"}, status_code=503)
        if state["mode"] == "slow":
            await asyncio.sleep(2.0)
        docs = [[{"document": {"id": "1", "contents": '"Hamlet"\nHamlet is by Shakespeare.'}, "score": 1.0}]]
        return {"result": docs * len(body["queries"])}

    return app


@pytest.fixture(scope="module")
def retriever() -> Iterator[tuple[str, dict]]:
    state = {"mode": "ok", "posts": 0}
    srv, _, url = serve_in_thread(_switchable_app(state))
    yield url, state
    srv.should_exit = True


def script(ctx: str) -> str:
    """Search once, then answer."""
    if ctx.count("</search>") == 0:
        return "<think> look it up </think><search> who wrote hamlet </search>"
    return "<think> done </think><answer> Shakespeare </answer>"


@pytest.fixture(scope="module")
def engine(tok, model):
    yield from scripted_hf(tok, model, script)


def _cfg(url: str, **breaker) -> RSearchConfig:
    cfg = RSearchConfig()
    cfg.retriever.url, cfg.retriever.topk, cfg.retriever.timeout_s, cfg.retriever.max_retries = url, 1, 0.5, 1
    cfg.retriever.cache = False
    cfg.rollout.max_turns, cfg.rollout.max_tokens_per_turn, cfg.rollout.max_response_length = 3, 48, 300
    for key, value in {"min_calls": 1, "probe_interval_s": 0.2, **breaker}.items():
        setattr(cfg.retriever.breaker, key, value)
    return cfg


def _prompts(tok, n: int):
    rows = [{"prompt": f"Q: who wrote hamlet {i}?\n", "golden_answers": ["Shakespeare"], "question": "q",
             "data_source": "toy"} for i in range(n)]  # fmt: skip
    return PromptDataset(rows, tok, max_prompt_length=64).to_batch(list(range(n)), uids=[f"u{i}" for i in range(n)])


def _observations(batch) -> list[str]:
    return [text for segs in batch.non_tensor_batch["segments"] for role, text in segs if role == "observation"]


def test_outage_pauses_rollout_until_the_retriever_is_back(tok, engine, retriever):
    url, state = retriever
    state.update(mode="outage", outage_s=1.5, down_since=None)  # down for 1.5 s from the first search
    cfg = _cfg(url, deadline_s=30.0)
    out = generate_batch(engine, tok, _prompts(tok, 3), cfg, protocol=protocol_for(cfg))
    obs = _observations(out)
    assert len(obs) == 3 and all("Hamlet is by Shakespeare" in o for o in obs), obs  # real passages, no errors
    assert not any(out.non_tensor_batch["search_failed"])
    metrics = out.meta_info["metrics"]
    assert metrics["search/breaker_trips"] == 1 and metrics["search/breaker_wait_s"] > 0
    assert metrics["search/errors"] == 0 and metrics["search/breaker_wait_s"] >= 1.0


def test_slow_retriever_bounded_retries_then_deadline(tok, engine, retriever):
    url, state = retriever
    state.update(mode="slow", posts=0, first_post=None)
    cfg = _cfg(url, deadline_s=2.0)
    with pytest.raises(RetrieverDownError, match="did not answer for .*deadline_s=2"):
        generate_batch(engine, tok, _prompts(tok, 2), cfg, protocol=protocol_for(cfg))
    elapsed = time.monotonic() - state["first_post"]  # from the first search (generation before it is not bounded)
    # the deadline, plus the failing search that opened the breaker and one retried search in flight at the deadline
    # ((1 + max_retries) x timeout + backoff each), plus slack for a loaded machine
    assert elapsed < 2.0 + 2 * (2 * 0.5 + 0.2) + 2.0, elapsed
    counts = process_search_client(cfg.retriever).metrics(reset=True)
    assert counts["search/retries"] >= 1 and counts["search/retries"] <= counts["search/requests"] / 2
    assert counts["search/errors"] >= 1  # each failed call: 1 + max_retries requests, then a breaker wait
    state["mode"] = "ok"


def test_breaker_off_failures_become_marked_error_observations(tok, engine, retriever):
    url, state = retriever
    state.update(mode="slow", posts=0)
    cfg = _cfg(url, enable=False)
    out = generate_batch(engine, tok, _prompts(tok, 2), cfg, protocol=protocol_for(cfg))
    state["mode"] = "ok"
    assert _observations(out) == ["\n\n<information>search failed: timeout</information>\n\n"] * 2
    assert list(out.non_tensor_batch["search_failed"]) == [True, True]
    metrics = out.meta_info["metrics"]
    # bounded retries: every request the client sent was tried 1 + max_retries times, then given up
    assert metrics["search/errors"] == 2 and metrics["search/requests"] == 2 * metrics["search/retries"] > 0
    assert state["posts"] == metrics["search/requests"]
    assert "search/breaker_trips" not in metrics
