"""Chunked log-probs (rsearch_verl/workers/logprobs.py `chunked_log_probs`): the same values and gradients as the
unchunked computation, whatever the chunking, and a backward graph that holds no float32 full-vocabulary tensor.

- float32: every chunk size (one position, blocks splitting a row, blocks of several rows, one block) gives log-probs,
  entropy and gradients within 1e-6 of the unchunked (single-block) result;
- float64: equal to the formula the actor used before chunking (log_softmax + gather; verl's entropy_from_logits)
  within 1e-12, with the temperature, so the chunked code computes the same function, not just a stable one;
- through a tiny Qwen2: response log-probs and parameter gradients do not depend on actor.logprob_chunk_size;
- the autograd graph saves the caller's logits and [B, T] statistics only (measured with saved-tensor hooks).

Run: .venv/bin/python -m pytest -q tests/workers/test_workers_logprob_chunks.py
"""

from __future__ import annotations

import pytest
import torch
from verl import DataProto
from verl.utils.torch_functional import entropy_from_logits

from rsearch_verl.config import TinyModelConfig
from rsearch_verl.models import build_tiny_qwen2
from rsearch_verl.workers.forward import response_log_probs
from rsearch_verl.workers.logprobs import chunked_log_probs

V = 97
CHUNKS = [1, 3, 7, 8, 40, 10_000]  # 7 = one row of a [B, 7] grid; 40: several rows per block; 10_000: one block


def _case(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    targets = torch.randint(0, V, shape, generator=g)
    w_lp, w_ent = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g)
    return logits, targets, w_lp, w_ent.double()


def _run(fn, logits, w_lp, w_ent):
    """(log-probs, entropy, d loss / d logits) for loss = sum(w_lp * lp + w_ent * H)."""
    x = logits.clone().requires_grad_()
    lp, ent = fn(x)
    ((lp * w_lp.to(lp.dtype)).sum() + (ent * w_ent.to(ent.dtype)).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("shape", [(3, 7), (19,)], ids=["padded", "packed"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_unchunked_float32(shape, temperature):
    logits, targets, w_lp, w_ent = _case(shape, torch.float32)
    ref = _run(lambda x: chunked_log_probs(x, targets, temperature, 10**9, True), logits, w_lp, w_ent)
    assert ref[2].abs().max() > 0.1  # the check below compares real gradients
    for chunk in CHUNKS:
        got = _run(lambda x, c=chunk: chunked_log_probs(x, targets, temperature, c, True), logits, w_lp, w_ent)
        for name, a, b in zip(("log-probs", "entropy", "gradient"), got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m, n=name, c=chunk: f"chunk {c} {n}: {m}")


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_equals_the_unchunked_formula_float64(temperature):
    logits, targets, w_lp, w_ent = _case((4, 6), torch.float64, seed=1)

    def before(x):  # the actor's computation before chunking (in float64 here, so only the formula is compared)
        z = x / temperature
        lp = torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return lp, entropy_from_logits(z)

    ref = _run(before, logits, w_lp, w_ent)
    for chunk in (1, 5, 10_000):
        got = _run(lambda x, c=chunk: chunked_log_probs(x, targets, temperature, c, True), logits, w_lp, w_ent)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_log_probs_alone_and_bf16_logits():
    """Without entropy only the log-prob path runs (and backpropagates); bf16 logits are upcast per chunk, so the
    result is the float32 computation on the bf16 values, with a bf16 gradient for the bf16 logits."""
    logits, targets, w_lp, _ = _case((2, 9), torch.bfloat16, seed=2)
    x = logits.clone().requires_grad_()
    lp, ent = chunked_log_probs(x, targets, 1.0, 4, with_entropy=False)
    assert ent is None and lp.dtype == torch.float32
    (lp * w_lp.float()).sum().backward()
    y = logits.float().requires_grad_()
    ref = torch.log_softmax(y, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (ref * w_lp.float()).sum().backward()
    torch.testing.assert_close(lp, ref.detach(), rtol=0, atol=1e-6)
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.float(), y.grad, rtol=1e-2, atol=1e-3)  # bf16 rounding of the gradient


def _data(vocab: int, b: int = 3, p: int = 5, r: int = 11) -> DataProto:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (b, p + r), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :2] = 0  # left padding
    attn[2, -3:] = 0  # right padding
    tensors = {
        "input_ids": ids,
        "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, p:],
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": 0.8})


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_model_gradients_do_not_depend_on_the_chunk_size(remove_padding):
    model = build_tiny_qwen2(TinyModelConfig(), 300, seed=0)
    data = _data(300)
    mask = data.batch["attention_mask"][:, 5:].bool()
    out = {}
    for chunk in (2, 5, 1024):
        model.zero_grad(set_to_none=True)
        lp, ent = response_log_probs(model, data, torch.device("cpu"), True, remove_padding, chunk_size=chunk)
        ((lp - 0.1 * ent) * mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out[chunk] = (lp.detach(), ent.detach(), grads)
    ref_lp, ref_ent, ref_g = out[1024]
    assert max(float(g.abs().max()) for g in ref_g.values()) > 1e-3
    for chunk in (2, 5):
        lp, ent, grads = out[chunk]
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-6)
        torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-6)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_g[n], rtol=0, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def _saved_bytes(fn, logits) -> int:
    """Bytes of the tensors autograd saves for the backward of fn(logits) (the logits themselves not counted)."""
    sizes = []

    def pack(t):
        if t.data_ptr() != logits.data_ptr():
            sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits)
    return sum(sizes)


def test_backward_keeps_no_float32_vocabulary_tensor():
    logits = torch.randn(4, 64, 1000, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 1000, (4, 64))

    def unchunked(x):
        z = x.float()
        return torch.log_softmax(z, -1).gather(-1, targets.unsqueeze(-1)), entropy_from_logits(z)

    full_fp32 = logits.numel() * 4
    assert _saved_bytes(unchunked, logits) >= 2 * full_fp32  # the cost the chunking removes
    saved = _saved_bytes(lambda x: chunked_log_probs(x, targets, 0.9, 32, True), logits)
    assert saved <= 3 * 4 * 64 * 8 + 4 * 64 * 8  # lse, entropy (float32) and targets (int64) per position only
