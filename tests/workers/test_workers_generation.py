"""The split rollout worker under weight updates that arrive while it generates (trainer.mid_trajectory_update).

The real `GenerationWorker` (its methods called in-process, as its Ray actor threads would) around the real HF engine
and agent loop, with a tiny random Qwen2. An update pushed mid-batch either lands between two decode steps
(`continue`: the batch's tokens carry both versions) or is parked until the batch is done (`wait`: every token of the
batch carries the old version, the next batch the new one).

Run: .venv/bin/python -m pytest -q tests/workers/test_workers_generation.py
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rsearch_verl.config import RSearchConfig, TinyModelConfig, to_dict
from rsearch_verl.data.dataset import PromptDataset
from rsearch_verl.models import DEFAULT_TOKENIZER_TEXTS, build_tiny_qwen2, train_bpe_tokenizer
from rsearch_verl.workers.generation import GenerationRunner, GenerationWorker


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(DEFAULT_TOKENIZER_TEXTS, vocab_size=512)


def _worker(tok, mode: str, monkeypatch) -> GenerationWorker:
    # what a Ray worker process gets; the Worker base class also sets the LOCAL_* / REDIS_* ones (restored after)
    env = {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "LOCAL_WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "REDIS_STORE_SERVER_HOST": "127.0.0.1"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = RSearchConfig()
    cfg.trainer.placement, cfg.trainer.max_staleness, cfg.trainer.mid_trajectory_update = "split", 1, mode
    cfg.algorithm.adv_estimator = "gae"  # any valid recipe; the worker only generates
    cfg.rollout.max_turns, cfg.rollout.max_tokens_per_turn, cfg.rollout.max_response_length = 1, 300, 300
    cfg.retriever.url, cfg.retriever.max_retries = "http://127.0.0.1:9", 0  # a search (if any) gets an error
    worker = GenerationWorker(to_dict(cfg))
    model = build_tiny_qwen2(TinyModelConfig(), len(tok), seed=0)
    worker.runner = GenerationRunner(worker.cfg, model, tok, torch.device("cpu"))
    return worker


def _prompts(tok, min_version: int):
    rows = [{"prompt": f"Q: who wrote hamlet {i}?\n", "golden_answers": ["x"], "question": "q", "data_source": "toy"}
            for i in range(2)]  # fmt: skip
    batch = PromptDataset(rows, tok, max_prompt_length=64).to_batch([0, 1], uids=["u0", "u1"])
    batch.meta_info.update(seed=3, validate=False, min_version=min_version)
    return batch


def _versions(out) -> set[int]:
    """The policy versions that sampled the batch's tokens (observation and padding positions excluded)."""
    b = out.batch
    return set(b["rollout_versions"][b["response_mask"].bool()].tolist())


@pytest.mark.parametrize("mode", ["continue", "wait"])
def test_update_mid_batch_continues_or_waits(tok, mode, monkeypatch):
    worker = _worker(tok, mode, monkeypatch)
    engine = worker.runner.engine
    new = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new["lm_head.weight"] = torch.zeros_like(new["lm_head.weight"])
    pushed = {}

    def push():  # the driver's weight sync, while the batch decodes
        deadline = time.monotonic() + 60
        while engine.counters["decode_steps"] < 5 and time.monotonic() < deadline:
            time.sleep(0.0005)
        worker.load_weights(new, version=1)
        pushed["engine_version"] = worker.runner.version  # what the engine holds when the push returns

    try:
        pusher = threading.Thread(target=push)
        pusher.start()
        out = worker.generate_sequences_async(_prompts(tok, min_version=0))
        pusher.join()
        if mode == "continue":  # landed between two decode steps: a partial rollout
            assert pushed["engine_version"] == 1 and _versions(out) == {0, 1}
        else:  # parked until the batch was done, then applied before the next one
            assert pushed["engine_version"] == 0 and _versions(out) == {0}
        assert worker.runner.version == 1 and worker._parked is None
        again = worker.generate_sequences_async(_prompts(tok, min_version=1))
        assert _versions(again) == {1}
    finally:
        worker.runner.close()


def test_batch_waits_for_the_version_it_needs(tok, monkeypatch):
    """A batch that needs policy version 1 starts only once it is in (the staleness bound's worker side)."""
    worker = _worker(tok, "wait", monkeypatch)
    new = {k: v.clone() for k, v in worker.runner.engine.model.state_dict().items()}
    result = {}
    try:
        gen = threading.Thread(target=lambda: result.update(out=worker.generate_sequences_async(_prompts(tok, 1))))
        gen.start()
        time.sleep(0.5)
        assert "out" not in result and worker.runner.engine.counters["decode_steps"] == 0  # still waiting
        worker.load_weights(new, version=1)
        gen.join(timeout=60)
        assert _versions(result["out"]) == {1}
    finally:
        worker.runner.close()
