"""The benchmarks' heavy-tailed scripted policy (rsearch_verl/testing/turn_script.py): its tail, and that it drives
the real agent loop through that many searches (HF engine, a real BM25 server).

Run: .venv/bin/python -m pytest -q tests/rollout/test_turn_script.py
"""

from __future__ import annotations

import asyncio

from conftest import scripted_hf

from rsearch_verl.config import RSearchConfig
from rsearch_verl.rollout.agent_loop import run_trajectory
from rsearch_verl.rollout.engines import SamplingParams
from rsearch_verl.rollout.protocols import get_protocol
from rsearch_verl.search.client import SearchClient
from rsearch_verl.testing.turn_script import heavy_tail_script, searches_for


def test_searches_are_heavy_tailed():
    counts = [searches_for(f"who founded company {i}?", 16) for i in range(2000)]
    share = {s: sum(c >= s for c in counts) / len(counts) for s in (1, 3, 7, 15)}
    for s, p in share.items():  # P(>= s) = 1 / (s + 1), within sampling error
        assert abs(p - 1 / (s + 1)) < 0.03, share
    assert max(counts) == 16 and min(counts) == 0


def test_the_script_drives_the_agent_loop_through_its_searches(tok, model, retrieval_url):
    proto = get_protocol("search_r1")
    cfg = RSearchConfig()
    cfg.retriever.url, cfg.retriever.topk = retrieval_url, 1
    cfg.rollout.max_turns, cfg.rollout.max_tokens_per_turn, cfg.rollout.max_obs_length = 20, 48, 24
    cfg.rollout.max_response_length = 1500
    question = next(q for q in (f"who wrote play {i}?" for i in range(500)) if searches_for(q, 16) == 5)
    engine = next(scripted_hf(tok, model, heavy_tail_script(16)))
    try:
        prompt = tok.encode(proto.build_prompt(question, "base"))
        sampling = SamplingParams(temperature=1.0, max_tokens=48, seed=1)
        traj = asyncio.run(run_trajectory(engine, tok, proto, SearchClient(cfg.retriever), prompt, cfg, sampling))
    finally:
        engine.close()
    assert (traj.n_searches, traj.n_turns, traj.finish_reason) == (5, 6, "answer")
