"""The actor's response log-probs describe the distribution the rollout engine sampled from: at the rollout
temperature (meta_info["temperature"], as verl passes it), they equal the HF engine's own log-probs.

Run: .venv/bin/python -m pytest -q tests/workers/test_workers_forward.py
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from verl import DataProto

from rsearch_verl.config import RolloutConfig, TinyModelConfig
from rsearch_verl.models import DEFAULT_TOKENIZER_TEXTS, build_tiny_qwen2, train_bpe_tokenizer
from rsearch_verl.rollout.engines import SamplingParams, make_engine
from rsearch_verl.workers.forward import response_log_probs


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(DEFAULT_TOKENIZER_TEXTS, vocab_size=512)


def _batch(prompt: list[int], response: list[int], meta: dict) -> DataProto:
    ids = torch.tensor([prompt + response])
    tensors = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(ids.shape[1])[None],
        "responses": torch.tensor([response]),
    }
    return DataProto.from_dict(tensors=tensors, meta_info=meta)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.5])
def test_actor_log_probs_match_the_engine_at_the_rollout_temperature(tok, temperature):
    model = build_tiny_qwen2(TinyModelConfig(), len(tok), seed=0).eval()
    engine = make_engine(RolloutConfig(), model, tok)
    try:
        prompt = tok.encode("Answer the given question.")
        out = asyncio.run(engine.generate(prompt, SamplingParams(temperature, max_tokens=12, seed=5), []))
    finally:
        engine.close()
    assert len(out.token_ids) == 12
    engine_lp = torch.tensor(out.logprobs)
    with torch.no_grad():
        lp, entropy = response_log_probs(
            model, _batch(prompt, out.token_ids, {"temperature": temperature}), torch.device("cpu"), True
        )
        raw, raw_entropy = response_log_probs(model, _batch(prompt, out.token_ids, {}), torch.device("cpu"), True)
    assert torch.allclose(lp[0], engine_lp, atol=1e-5)
    if temperature != 1.0:  # without the temperature the actor would train a different policy than it sampled
        assert not torch.allclose(raw[0], engine_lp, atol=1e-3)
        assert (entropy < raw_entropy).all() == (temperature < 1.0)


def test_non_positive_temperature_is_refused(tok):
    model = build_tiny_qwen2(TinyModelConfig(), len(tok), seed=0)
    with pytest.raises(ValueError, match="temperature"):
        response_log_probs(model, _batch([1, 2, 3], [4, 5], {"temperature": 0.0}), torch.device("cpu"))
