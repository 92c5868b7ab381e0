"""HF rollout engine: stop strings, EOS, max_tokens, seeding, greedy, batching and weight sync (real torch, tiny
random Qwen2 built from a config, the offline BPE tokenizer).

Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_hf_engine.py
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rsearch_verl.config import RolloutConfig, TinyModelConfig
from rsearch_verl.models import DEFAULT_TOKENIZER_TEXTS, build_tiny_qwen2, train_bpe_tokenizer
from rsearch_verl.rollout.engines import SamplingParams, make_engine
from rsearch_verl.rollout.engines.hf import HFEngine, filtered_logprobs
from rsearch_verl.testing.scripted_engines import ScriptedHFEngine

STOP = ["</search>", "</answer>"]


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(DEFAULT_TOKENIZER_TEXTS, vocab_size=512)


def _model(tok, seed: int = 0):
    return build_tiny_qwen2(TinyModelConfig(), len(tok), seed=seed)


def _forward_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(tokens | prompt) by a plain, unbatched forward (the actor's view)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def _run(coro):
    return asyncio.run(coro)


def test_stop_string_keeps_nothing_after_it(tok):
    script = lambda ctx: "<think> hm </think><search> who founded it </search> extra words after"  # noqa: E731
    engine = ScriptedHFEngine(_model(tok), tok, script)
    try:
        prompt = tok.encode("Question: x?")
        out = _run(engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=64, seed=1), STOP))
        text = tok.decode(out.token_ids)
        assert out.finish_reason == "stop" and out.stop_string == "</search>"
        assert text.endswith("</search>") and "extra" not in text
        assert len(out.logprobs) == len(out.token_ids)
        # the forced tokens' logprobs are the model's own (temperature 1, no filtering)
        ref = _forward_logprobs(engine.model, prompt, out.token_ids)
        assert torch.allclose(ref, torch.tensor(out.logprobs), atol=1e-5)
    finally:
        engine.close()


def test_eos_and_max_tokens(tok):
    engine = ScriptedHFEngine(_model(tok), tok, lambda ctx: "<answer> yes" + tok.eos_token + " more")
    try:
        prompt = tok.encode("Q")
        out = _run(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=64), STOP))
        assert out.finish_reason == "eos" and out.token_ids[-1] == tok.eos_token_id
        assert tok.decode(out.token_ids[:-1]) == "<answer> yes"
        out = _run(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3), STOP))
        assert out.finish_reason == "length" and len(out.token_ids) == 3
    finally:
        engine.close()


def test_seed_reproduces_and_batching_matches_single_calls(tok):
    engine = HFEngine(_model(tok), tok)
    prompts = [tok.encode("Question: who wrote hamlet?"), tok.encode("hi"), tok.encode("The quick brown fox")]

    async def many(seed_base: int):
        calls = [engine.generate(p, SamplingParams(1.0, max_tokens=12, seed=seed_base + i), []) for i, p in
                 enumerate(prompts)]  # fmt: skip
        return await asyncio.gather(*calls)

    try:
        first, again, other = _run(many(10)), _run(many(10)), _run(many(99))
        assert max(r.timing["batch_size"] for r in first) > 1  # concurrent calls shared a batch
        assert [r.token_ids for r in first] == [r.token_ids for r in again]
        assert [r.token_ids for r in first] != [r.token_ids for r in other]
        # one call alone (no left padding) samples the same tokens as inside the padded batch
        alone = _run(engine.generate(prompts[1], SamplingParams(1.0, max_tokens=12, seed=11), []))
        assert alone.token_ids == first[1].token_ids
        for p, r in zip(prompts, first, strict=True):
            assert torch.allclose(_forward_logprobs(engine.model, p, r.token_ids), torch.tensor(r.logprobs), atol=1e-5)
    finally:
        engine.close()


def test_requests_join_a_running_batch_and_leave_it_early(tok):
    """Continuous batching: a request that arrives mid-decode joins the running batch (left-padded cache merge), is
    answered before the long one finishes, and both sample exactly what they sample alone, with exact logprobs."""
    engine = HFEngine(_model(tok), tok, continuous=True)
    long_p, short_p = tok.encode("The quick brown fox jumps"), tok.encode("hi")
    long_s, short_s = SamplingParams(1.0, max_tokens=400, seed=4), SamplingParams(1.0, max_tokens=6, seed=5)

    async def overlapped():
        long_task = asyncio.ensure_future(engine.generate(long_p, long_s, []))
        await asyncio.sleep(0.1)  # the long request is decoding by now
        short = await engine.generate(short_p, short_s, [])
        assert not long_task.done()  # answered while the long row keeps decoding
        return await long_task, short

    try:
        long_out, short_out = _run(overlapped())
        assert short_out.timing["batch_size"] == 2 and long_out.timing["batch_size"] == 2
        assert short_out.token_ids == _run(engine.generate(short_p, short_s, [])).token_ids
        assert long_out.token_ids == _run(engine.generate(long_p, long_s, [])).token_ids
        for p, r in ((long_p, long_out), (short_p, short_out)):
            assert torch.allclose(_forward_logprobs(engine.model, p, r.token_ids), torch.tensor(r.logprobs), atol=1e-5)
    finally:
        engine.close()


def test_continuous_greedy_with_staggered_joins_matches_static_and_generate(tok):
    """Greedy decoding is the same with mid-decode joins (continuous) as in a static batch and as HF `generate` alone:
    joins of shorter and longer prompts (both caches re-aligned), rows leaving first (padding columns dropped) and
    the KV buffer growing past its spare room all keep the tokens and the logprobs exact."""
    model = _model(tok)
    prompts = [tok.encode("The quick brown fox jumps over the lazy dog"), tok.encode("hi"), tok.encode("who wrote it")]
    budgets = [200, 300, 20]  # the first (longest prompt) leaves before the second; the third joins last
    counters = {}

    async def staggered(engine):
        tasks = []
        for p, n in zip(prompts, budgets, strict=True):
            tasks.append(asyncio.ensure_future(engine.generate(p, SamplingParams(0.0, max_tokens=n), [])))
            await asyncio.sleep(0.05)  # the earlier requests are decoding by now
        return await asyncio.gather(*tasks)

    outs = {}
    for continuous in (True, False):
        engine = HFEngine(model, tok, continuous=continuous)
        try:
            outs[continuous] = _run(staggered(engine))
            counters[continuous] = dict(engine.counters)
        finally:
            engine.close()
    assert max(r.timing["batch_size"] for r in outs[True]) == 3  # everyone joined the running batch
    assert counters[True]["decode_steps"] < sum(budgets)  # rows shared decode steps
    with torch.no_grad():
        for p, n, cont, static in zip(prompts, budgets, outs[True], outs[False], strict=True):
            ref = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(p) :]
            assert cont.token_ids == static.token_ids == ref.tolist()
            assert torch.allclose(_forward_logprobs(model, p, cont.token_ids), torch.tensor(cont.logprobs), atol=1e-5)


def test_sliding_window_cache_is_never_joined_into(tok):
    """A model whose cache has sliding-window layers cannot be re-aligned: a late request waits for the running batch
    to drain instead of joining it, and both requests still get exactly their greedy tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1, use_sliding_window=True, sliding_window=16,
                         max_window_layers=0, tie_word_embeddings=True)  # fmt: skip
    model = Qwen2ForCausalLM(config).eval()
    engine = HFEngine(model, tok)
    prompts = [tok.encode("The quick brown fox jumps"), tok.encode("hi")]

    async def staggered():
        first = asyncio.ensure_future(engine.generate(prompts[0], SamplingParams(0.0, max_tokens=400), []))
        await asyncio.sleep(0.05)  # the first is decoding by now
        second = await engine.generate(prompts[1], SamplingParams(0.0, max_tokens=10), [])
        return await first, second

    try:
        outs = _run(staggered())
        assert [r.timing["batch_size"] for r in outs] == [1.0, 1.0]
        with torch.no_grad():
            for p, r in zip(prompts, outs, strict=True):
                n = len(r.token_ids)
                ref = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
                assert r.token_ids == ref[0, len(p) :].tolist()
    finally:
        engine.close()


def test_greedy_is_argmax(tok):
    engine = HFEngine(_model(tok), tok)
    try:
        prompt = tok.encode("Question: what is the capital?")
        out = _run(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8), []))
        with torch.no_grad():
            ref = engine.model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
        assert out.token_ids == ref.tolist()[: len(out.token_ids)]
    finally:
        engine.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_load_weights_matches_plain_forward_of_source_model(tok, temperature):
    engine = make_engine(RolloutConfig(), _model(tok, seed=0), tok)
    source = _model(tok, seed=1)
    try:
        prompt = tok.encode("Answer the given question.")
        before = _run(engine.generate(prompt, SamplingParams(temperature, max_tokens=10, seed=3), []))
        engine.load_weights(source.state_dict())
        after = _run(engine.generate(prompt, SamplingParams(temperature, max_tokens=10, seed=3), []))
        ref = _forward_logprobs(source, prompt, after.token_ids)
        assert torch.allclose(ref, torch.tensor(after.logprobs), atol=1e-5)
        assert not torch.allclose(_forward_logprobs(source, prompt, before.token_ids), torch.tensor(before.logprobs))
    finally:
        engine.close()


def test_top_k_top_p_filtering():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    top1 = filtered_logprobs(logits, SamplingParams(temperature=1.0, top_k=1))
    assert top1[0] == 0 and torch.isinf(top1[1:]).all()
    p = torch.softmax(logits, -1)
    nucleus = filtered_logprobs(logits, SamplingParams(temperature=1.0, top_p=float(p[0] + p[1]) - 1e-4))
    kept = torch.isfinite(nucleus)
    assert kept.tolist() == [True, True, False, False]
    assert torch.allclose(nucleus[kept].exp().sum(), torch.tensor(1.0))
    hot = filtered_logprobs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.log_softmax(logits / 2, -1))


def test_bad_requests_and_weights(tok):
    engine = HFEngine(_model(tok), tok)
    try:
        with pytest.raises(ValueError):
            _run(engine.generate([], SamplingParams(), []))
        with pytest.raises(ValueError):
            _run(engine.generate([1], SamplingParams(max_tokens=0), []))
        with pytest.raises(KeyError):
            engine.load_weights({"nope.weight": torch.zeros(1)})
        with pytest.raises(ValueError):
            make_engine(RolloutConfig(engine="sglang"), engine.model, tok)
    finally:
        engine.close()
    with pytest.raises(RuntimeError):
        _run(engine.generate([1], SamplingParams(), []))


def test_weights_landing_mid_request_tag_each_token_with_its_version(tok):
    """An update that arrives while a request decodes lands between two decode steps: the tokens before it carry
    version 0 and the old weights' log-probs, every token after it version 7 and the new weights' (here a zero
    output layer: exactly uniform, -log V, whatever the KV cache holds)."""
    import threading
    import time

    model = _model(tok)
    engine = HFEngine(model, tok)
    new = {k: v.clone() for k, v in model.state_dict().items()}
    new["lm_head.weight"] = torch.zeros_like(new["lm_head.weight"])
    vocab = model.config.vocab_size

    def push():
        deadline = time.monotonic() + 60
        while engine.counters["decode_steps"] < 5 and time.monotonic() < deadline:
            time.sleep(0.0005)
        engine.load_weights(new, version=7)

    try:
        pusher = threading.Thread(target=push)
        pusher.start()
        params = SamplingParams(temperature=1.0, max_tokens=400, seed=11)
        out = _run(engine.generate(tok.encode("Question: who?"), params, []))
        pusher.join()
        first = out.versions.index(7)
        assert first >= 5 and set(out.versions[:first]) == {0} and set(out.versions[first:]) == {7}
        assert engine.version == 7
        uniform = torch.tensor(out.logprobs[first:])
        assert torch.allclose(uniform, torch.full_like(uniform, -torch.log(torch.tensor(float(vocab)))), atol=1e-5)
        assert not torch.allclose(torch.tensor(out.logprobs[:first]), uniform[:1].expand(first), atol=1e-3)
    finally:
        engine.close()
