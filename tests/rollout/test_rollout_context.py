"""Context management of long trajectories (rsearch_verl/rollout/context.py) against a REAL retrieval server and the
real HF engine with a scripted policy that always searches: 128 turns run to the end with folding, the context never
above its budget; without folding the trajectory ends at the budget with finish_reason "context". Rows: every token
trained once, in the context it was sampled in; observations and markers mask 0, the policy's notes mask 1.

Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_context.py
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import scripted_hf

from rsearch_verl.config import RSearchConfig
from rsearch_verl.rollout.agent_loop import run_trajectory
from rsearch_verl.rollout.context import NOTE_CLOSE, NOTE_OPEN, OMITTED
from rsearch_verl.rollout.engines import SamplingParams
from rsearch_verl.rollout.protocols import get_protocol
from rsearch_verl.rollout.trajectory import object_array, rows_to_batch
from rsearch_verl.search.client import SearchClient

BUDGET, PER_TURN, NOTE = 320, 24, 40


def always_search(ctx: str) -> str:
    """The scripted policy: write the note when the environment opened one, otherwise search again."""
    if ctx.endswith(NOTE_OPEN):
        return f" hamlet was written by shakespeare {NOTE_CLOSE}"
    return "<search> who wrote hamlet </search>"


@pytest.fixture(scope="module")
def engine(tok, model):
    yield from scripted_hf(tok, model, always_search)


def _cfg(url: str, strategy: str, turns: int = 128) -> RSearchConfig:
    cfg = RSearchConfig()
    cfg.retriever.url, cfg.retriever.topk, cfg.retriever.timeout_s = url, 2, 5.0
    rc = cfg.rollout
    rc.max_turns, rc.max_tokens_per_turn, rc.max_obs_length, rc.max_response_length = turns, PER_TURN, 64, 256
    rc.context.strategy, rc.context.max_tokens, rc.context.summary_max_tokens = strategy, BUDGET, NOTE
    return cfg


def _run(engine, tok, url, strategy, turns=128, response=256):
    cfg = _cfg(url, strategy, turns)
    cfg.rollout.max_response_length = response
    prompt = tok.encode("Q: who wrote hamlet? searches=many\n")
    sampling = SamplingParams(temperature=1.0, max_tokens=PER_TURN, seed=3)
    search = SearchClient(cfg.retriever, backoff_s=0.01)
    traj = asyncio.run(run_trajectory(engine, tok, get_protocol("search_r1"), search, prompt, cfg, sampling))
    return cfg, prompt, traj


@pytest.mark.parametrize("strategy", ["drop_observations", "summary"])
def test_128_turns_fold_within_budget(engine, tok, retrieval_url, strategy):
    cfg, prompt, traj = _run(engine, tok, retrieval_url, strategy)
    assert traj.n_turns == 128 and traj.finish_reason == "max_turns"
    assert traj.n_searches == 127
    assert traj.folds >= 10 and len(traj.rows) == traj.folds + 1
    # every generation (its new tokens included) stayed inside the budget, and so did every row
    reserve = NOTE + 8 if strategy == "summary" else 0
    assert max(traj.context_lens) + PER_TURN <= BUDGET + reserve
    assert max(r.context_len for r in traj.rows) <= BUDGET
    # bounded: the rows' contexts do not grow with the turn count (the last ten rows are no longer than the first ten)
    assert max(len(r.prompt_ids) for r in traj.rows[-10:]) <= max(len(r.prompt_ids) for r in traj.rows[:10]) + 16
    for row in traj.rows:
        assert row.prompt_ids[: len(prompt)] == prompt  # every context starts with the question
        assert len(row.response_ids) == len(row.response_mask) == len(row.logprobs) == len(row.versions)
        assert 1 in row.response_mask  # every row has policy tokens (it trains)
    if strategy == "summary":
        for prev, row in zip(traj.rows, traj.rows[1:], strict=False):
            note = [t for t, m in zip(prev.response_ids, prev.response_mask, strict=True) if m == 1]
            # the new context is the prompt, the note's opening tag and the note the policy wrote (mask 1 in its row)
            assert tok.decode(row.prompt_ids[len(prompt) :]).startswith(NOTE_OPEN)
            assert tok.decode(row.prompt_ids).endswith(tok.decode(note[-8:]))
            assert "shakespeare" in tok.decode(note)
    else:
        later = tok.decode(traj.rows[-1].prompt_ids)
        assert OMITTED in later and later.count("<information>") >= 2  # markers and the newest observation
        for row in traj.rows[1:]:  # every fold keeps the newest observation whole: the next turn reads its facts
            newest = tok.decode(row.prompt_ids).rsplit("<information>", 1)[1]
            assert OMITTED not in newest and "Hamlet" in newest


def test_none_ends_at_the_budget(engine, tok, retrieval_url):
    cfg, _, traj = _run(engine, tok, retrieval_url, "none", response=1000)  # the context budget binds first
    assert traj.finish_reason == "context" and traj.n_turns < 128
    assert len(traj.rows) == 1 and traj.folds == 0
    assert traj.rows[0].context_len <= BUDGET


@pytest.mark.parametrize("strategy", ["drop_observations", "summary"])
def test_rows_masks(engine, tok, retrieval_url, strategy):
    """In the batch rows: observation tokens (and markers, and the environment's `<note>`) mask 0, everything the
    policy sampled (its notes included) mask 1, each exactly once across the rows."""
    _, _, traj = _run(engine, tok, retrieval_url, strategy, turns=24)
    nt = {"uid": object_array(["u0"]), "question": object_array(["q"])}
    tensors, out = rows_to_batch([traj], nt, pad_id=0)
    assert len(out["traj_id"]) == len(traj.rows) > 1
    assert list(out["last_segment"]) == [False] * (len(traj.rows) - 1) + [True]
    policy = torch.cat([tensors["responses"][i][tensors["response_mask"][i].bool()] for i in range(len(traj.rows))])
    inserted = torch.cat(
        [
            tensors["responses"][i][
                (tensors["response_mask"][i] == 0)
                & tensors["attention_mask"][i, -tensors["responses"].shape[1] :].bool()
            ]
            for i in range(len(traj.rows))
        ]  # fmt: skip
    )
    policy_text, inserted_text = tok.decode(policy.tolist()), tok.decode(inserted.tolist())
    assert policy_text.count("<search>") == 24 and "<information>" not in policy_text
    assert inserted_text.count("<information>") == 23 and "<search>" not in inserted_text
    if strategy == "summary":
        assert policy_text.count(NOTE_CLOSE) == traj.folds and NOTE_CLOSE not in inserted_text
        assert inserted_text.count(NOTE_OPEN) == traj.folds
