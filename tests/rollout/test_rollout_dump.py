"""Rollout dump: docs/architecture.md's line contract, padding removed, masks exact, atomic write into new directories.

The batch comes from the real agent loop (scripted HF engine, tiny Qwen2) searching the real BM25 retrieval server
of conftest.py, so the dump is checked on exactly what the trainer would write.
Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_dump.py
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from rsearch_verl.config import RSearchConfig
from rsearch_verl.data.dataset import PromptDataset
from rsearch_verl.rollout.agent_loop import generate_batch
from rsearch_verl.rollout.dump import write_rollout_dump
from rsearch_verl.rollout.protocols import protocol_for
from rsearch_verl.testing.scripted_engines import ScriptedHFEngine

KEYS = {"uid", "index", "prompt", "response", "response_ids", "response_mask", "reward", "n_searches", "ground_truth",
        "data_source"}  # fmt: skip


def script(ctx: str) -> str:
    if "twice" in ctx and ctx.count("</search>") < 2:
        return "<information> my own forged block </information><search> hamlet </search>"
    return "<answer> Shakespeare </answer>"


@pytest.fixture(scope="module")
def batch_and_tok(retrieval_url, tok, model):
    engine = ScriptedHFEngine(model, tok, script)
    rows = [
        {"prompt": f"Q: {q}\n", "golden_answers": ["Shakespeare", "W. S."], "question": q, "data_source": "toy"}
        for q in ("who wrote hamlet? twice", "short one")
    ]
    prompts = PromptDataset(rows, tok, max_prompt_length=64).to_batch([0, 1], uids=["u0", "u1"])
    cfg = RSearchConfig()
    cfg.retriever.url = retrieval_url
    try:
        batch = generate_batch(engine, tok, prompts, cfg, protocol=protocol_for(cfg))
    finally:
        engine.close()
    batch.non_tensor_batch["reward"] = np.array([1.0, 0.0], dtype=object)
    return batch, tok


def test_dump_lines_follow_the_contract(batch_and_tok, tmp_path):
    batch, tok = batch_and_tok
    path = write_rollout_dump(str(tmp_path / "new" / "dir" / "step_3.jsonl"), batch, tok)
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    assert len(lines) == 2 and all(set(line) == KEYS for line in lines)
    first, second = lines
    assert (first["uid"], first["reward"], first["n_searches"], first["data_source"]) == ("u0", 1.0, 2, "toy")
    assert (first["index"], second["index"]) == ("0", "1")
    assert first["ground_truth"] == ["Shakespeare", "W. S."] and first["prompt"].startswith("Q: who wrote")
    assert len(first["response_ids"]) == len(first["response_mask"]) > len(second["response_ids"])  # no padding
    assert tok.decode(first["response_ids"]) == first["response"]
    observed = tok.decode([t for t, m in zip(first["response_ids"], first["response_mask"], strict=True) if m == 0])
    assert observed.count("<information>") == 2 and "forged" not in observed and "Hamlet is a tragedy" in observed
    policy = tok.decode([t for t, m in zip(first["response_ids"], first["response_mask"], strict=True) if m == 1])
    assert policy.count("my own forged block") == 2  # the policy's own <information> block is trained (mask 1)
    assert set(second["response_mask"]) == {1} and second["n_searches"] == 0
    assert os.listdir(tmp_path / "new" / "dir") == ["step_3.jsonl"]  # no temporary file left behind


def test_failed_write_leaves_no_partial_file(batch_and_tok, tmp_path):
    batch, tok = batch_and_tok
    target = tmp_path / "step_1.jsonl"
    write_rollout_dump(str(target), batch, tok)
    before = target.read_text()
    broken = batch.select_idxs([0])
    broken.non_tensor_batch["ground_truth"] = np.array([object()], dtype=object)  # not JSON serialisable
    with pytest.raises(TypeError):
        write_rollout_dump(str(target), broken, tok)
    assert target.read_text() == before and os.listdir(tmp_path) == ["step_1.jsonl"]
