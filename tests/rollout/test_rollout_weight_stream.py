"""Streamed, bucketed weight sync and sleep states on the HF engine (the CPU path of the colocated sync): a stream
of (name, tensor) pairs loaded in several small buckets equals loading the state dict; a stream is atomic w.r.t.
decode steps (no step runs between its buckets, tokens after it carry the new version) and is consumed on the
caller's thread; a bad stream raises and keeps the version; sleep / wake_up states and GenerationRunner's call order
(wake weights -> load -> wake KV cache; generate -> sleep; weights restored after a level-2 sleep).

Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_weight_stream.py
"""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch

from rsearch_verl.config import TinyModelConfig
from rsearch_verl.models import DEFAULT_TOKENIZER_TEXTS, build_tiny_qwen2, train_bpe_tokenizer
from rsearch_verl.rollout.engines import SamplingParams, iter_buckets
from rsearch_verl.rollout.engines.hf import HFEngine

SMALL_MB = 0.05  # ~52 KB: the tiny model's ~0.2 MB of weights arrive in several buckets


@pytest.fixture(scope="module")
def tok():
    return train_bpe_tokenizer(DEFAULT_TOKENIZER_TEXTS, vocab_size=512)


def _model(tok, seed: int = 0):
    return build_tiny_qwen2(TinyModelConfig(), len(tok), seed=seed)


def _gen(engine, prompt, **sampling):
    return asyncio.run(engine.generate(prompt, SamplingParams(**sampling), []))


class _Spy(HFEngine):
    """Records (tensors, bytes) of every bucket it loads."""

    def apply_weights(self, buckets) -> None:
        self.bucket_sizes = []

        def counted():
            for bucket in buckets:
                self.bucket_sizes.append((len(bucket), sum(t.numel() * t.element_size() for _, t in bucket)))
                yield bucket

        super().apply_weights(counted())


def test_iter_buckets_is_lazy_and_bounded():
    pulled = []

    def pairs():
        for i, n in enumerate([10, 10, 10, 50, 5]):
            pulled.append(i)
            yield f"t{i}", torch.zeros(n)  # float32: 4 bytes per element

    buckets = iter_buckets(pairs(), bucket_bytes=80)
    first = next(buckets)
    assert [n for n, _ in first] == ["t0", "t1"] and pulled == [0, 1, 2]  # pulled one past the bucket, no more
    rest = [[n for n, _ in b] for b in buckets]
    assert rest == [["t2"], ["t3"], ["t4"]]  # a tensor larger than a bucket is a bucket of its own


def test_streamed_buckets_equal_loading_the_state_dict(tok):
    source = _model(tok, seed=1)
    by_dict, by_stream = HFEngine(_model(tok), tok), _Spy(_model(tok), tok, bucket_mb=SMALL_MB)
    try:
        by_dict.load_weights(source.state_dict(), version=3)
        by_stream.load_weights(((k, v.clone()) for k, v in source.state_dict().items()), version=3)
        sizes = by_stream.bucket_sizes
        assert len(sizes) >= 3 and all(size <= by_stream.bucket_bytes or n == 1 for n, size in sizes), sizes
        for (name, a), b in zip(by_dict.model.state_dict().items(), by_stream.model.state_dict().values(), strict=True):
            assert torch.equal(a, b), name
        assert by_dict.version == by_stream.version == 3
        prompt = tok.encode("Answer the given question.")
        a, b = _gen(by_dict, prompt, max_tokens=8, seed=2), _gen(by_stream, prompt, max_tokens=8, seed=2)
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    finally:
        by_dict.close()
        by_stream.close()


def test_bad_streams_raise_and_keep_the_version(tok):
    engine = HFEngine(_model(tok), tok, bucket_mb=SMALL_MB)
    try:
        state = engine.model.state_dict()
        with pytest.raises(KeyError, match="unknown"):
            engine.load_weights(iter([("nope.weight", torch.zeros(1))]), version=5)
        with pytest.raises(KeyError, match="missing"):
            engine.load_weights(iter(list(state.items())[:3]), version=5)
        assert engine.version == 0
        engine.load_weights(iter(state.items()), version=5)  # the engine still takes a good one
        assert engine.version == 5
    finally:
        engine.close()


def test_stream_lands_between_two_decode_steps_on_the_callers_thread(tok):
    """A slow stream (a pause per tensor, as FSDP gathers would take) pushed while a request decodes: no decode step
    runs while its buckets load, the tokens after it carry its version and the new weights' log-probs (a zero output
    layer: exactly uniform), and every tensor is pulled on the pushing thread."""
    model = _model(tok)
    engine = HFEngine(model, tok, bucket_mb=SMALL_MB)
    new = {k: v.clone() for k, v in model.state_dict().items()}
    new["lm_head.weight"] = torch.zeros_like(new["lm_head.weight"])
    new["model.embed_tokens.weight"] = torch.zeros_like(new["model.embed_tokens.weight"])  # tied: both zero
    seen = []  # (thread, decode steps so far) at each pull

    def stream():
        for name, tensor in new.items():
            seen.append((threading.get_ident(), engine.counters["decode_steps"]))
            time.sleep(0.002)
            yield name, tensor

    def push():
        deadline = time.monotonic() + 60
        while engine.counters["decode_steps"] < 5 and time.monotonic() < deadline:
            time.sleep(0.0005)
        pusher_id.append(threading.get_ident())
        engine.load_weights(stream(), version=9)

    pusher_id: list[int] = []
    try:
        pusher = threading.Thread(target=push)
        pusher.start()
        out = _gen(engine, tok.encode("Question: who?"), temperature=1.0, max_tokens=400, seed=11)
        pusher.join()
        assert {t for t, _ in seen} == set(pusher_id) and len({s for _, s in seen}) == 1  # no step in between
        first = out.versions.index(9)
        assert first >= 5 and set(out.versions[:first]) == {0} and set(out.versions[first:]) == {9}
        uniform = torch.tensor(out.logprobs[first + 1 :])  # the first new-version token was sampled from old logits
        assert torch.allclose(uniform, torch.full_like(uniform, -math.log(model.config.vocab_size)), atol=1e-5)
    finally:
        engine.close()


def test_sleep_and_wake_states(tok):
    engine = HFEngine(_model(tok), tok)
    prompt = tok.encode("hi")
    try:
        engine.sleep(level=1)  # weights kept (offloaded on an engine with a sleep mode)
        assert engine.asleep == ["weights", "kv_cache"] and not engine.weights_lost
        with pytest.raises(RuntimeError, match="asleep"):
            _gen(engine, prompt, max_tokens=2)
        engine.wake_up()
        assert len(_gen(engine, prompt, max_tokens=2).token_ids) == 2
        engine.sleep()  # level 2: the weights are gone until the next load
        engine.wake_up()
        with pytest.raises(RuntimeError, match="weights_lost=True"):
            _gen(engine, prompt, max_tokens=2)
        engine.sleep()
        engine.wake_up(["weights"])
        assert engine.asleep == ["kv_cache"]
        engine.load_weights(iter(engine.model.state_dict().items()), version=1)
        engine.wake_up(["kv_cache"])
        assert not engine.weights_lost and len(_gen(engine, prompt, max_tokens=2).token_ids) == 2
        with pytest.raises(ValueError):
            engine.wake_up(["gpu"])
        with pytest.raises(ValueError):
            engine.sleep(level=3)
    finally:
        engine.close()


class _Recorder:
    """A stand-in engine that records GenerationRunner's calls."""

    def __init__(self):
        self.calls, self.version, self.weights_lost = [], 0, False
        self.frees_memory_on_sleep = True  # the CUDA vLLM case: the runner sleeps it after every batch

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def sleep(self, level=2):
        self.calls.append(("sleep", level))
        self.weights_lost = level == 2

    def load_weights(self, weights, version=None):
        self.calls.append(("load_weights", [name for name, _ in weights], version))
        self.weights_lost = False


def test_runner_call_order(monkeypatch):
    """Sync: wake weights -> load -> wake KV cache (verl's order). Colocated generate: wake -> generate -> sleep(2);
    a second batch before the next sync first restores the same version from `restore()`."""
    import rsearch_verl.workers.generation as generation
    from rsearch_verl.workers.generation import GenerationRunner

    monkeypatch.setattr(generation, "generate_batch", lambda engine, *a, **k: engine.calls.append(("generate",)))
    runner = object.__new__(GenerationRunner)  # no config, model or protocol: only the engine calls matter here
    runner.engine, runner.tokenizer, runner.protocol = _Recorder(), None, None
    runner.cfg = type("Cfg", (), {"data": type("D", (), {"max_prompt_length": 1}), "rollout": type("R", (), {
        "max_response_length": 1})})  # fmt: skip
    restore = lambda: iter([("w", torch.zeros(1))])  # noqa: E731
    runner.load_weights(restore(), version=4)
    runner.engine.version = 4
    runner.generate(None, restore=restore)
    runner.generate(None, restore=restore)  # validation, then the next rollout, with no sync in between
    assert runner.engine.calls == [
        ("wake_up", ["weights"]),
        ("load_weights", ["w"], 4),
        ("wake_up", ["kv_cache"]),
        ("wake_up", None),
        ("generate",),
        ("sleep", 2),
        ("wake_up", ["weights"]),  # the weights were discarded: restored as the same version first
        ("load_weights", ["w"], 4),
        ("wake_up", ["kv_cache"]),
        ("wake_up", None),
        ("generate",),
        ("sleep", 2),
    ]
