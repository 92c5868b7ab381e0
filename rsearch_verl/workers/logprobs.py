"""Per-token log-probs and entropy from LM logits, a chunk of positions at a time in float32: an autograd Function
whose forward and backward never hold a float32 tensor over the whole [B, T, V] logits (with a 152k vocabulary,
0.6 MB per position never allocated; the backward recomputes each chunk's softmax from the caller's logits).
Pure torch (no verl import), so benchmarks/logprob_memory.py runs wherever torch does.

Usage:
    log_probs, entropy = chunked_log_probs(logits, targets, temperature, chunk_size=1024, with_entropy=True)
    # logits [B, T, V] or [N, V] (bf16 / fp32), targets [B, T] or [N] -> float32 [B, T] / [N] each

Tests: tests/workers/test_workers_logprob_chunks.py; memory: benchmarks/logprob_memory.py.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 1024  # as actor.logprob_chunk_size (rsearch_verl/config/schema.py)


def chunked_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / temperature) at `targets`, and the entropy when asked: logits [..., T, V] (any float
    dtype; a strided view is fine), targets [..., T] -> float32 (float64 for float64 logits) [..., T] each.

    Equal to the unchunked `log_softmax(logits.float() / t).gather(...)` and verl's `entropy_from_logits` (values and
    gradients; tests/workers/test_workers_logprob_chunks.py) but at most `chunk_size` positions at a time are float32
    full-vocabulary rows, in the backward too. (verl's `entropy_from_logits_with_chunking` is forward-only: under
    autograd every chunk's float32 graph stays alive; its CPU `logprobs_from_logits` takes bf16 log_softmax.)"""
    if chunk_size < 1:
        raise ValueError(f"chunked_log_probs: chunk_size must be >= 1, got {chunk_size}")
    flat = logits.dim() == 2
    if flat:  # one packed row [N, V]
        logits, targets = logits.unsqueeze(0), targets.unsqueeze(0)
    lead = logits.shape[:-1]
    logits, targets = logits.reshape(-1, *lead[-1:], logits.shape[-1]), targets.reshape(-1, lead[-1])
    log_probs, entropy = _ChunkedLogProbs.apply(logits, targets, float(temperature), int(chunk_size), with_entropy)
    out_shape = lead[1:] if flat else lead
    return log_probs.reshape(out_shape), (entropy.reshape(out_shape) if with_entropy else None)


def _blocks(rows: int, cols: int, chunk: int):
    """Index tuples covering a [rows, cols] grid with blocks of <= `chunk` cells: pieces of one row when rows are
    long (a packed row), several whole rows when they are short (padded responses)."""
    if cols >= chunk:
        for r in range(rows):
            for c in range(0, cols, chunk):
                yield slice(r, r + 1), slice(c, c + chunk)
    else:
        per = max(1, chunk // max(cols, 1))
        for r in range(0, rows, per):
            yield slice(r, r + per), slice(None)


def _work_copy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A fresh float32 (float64 for float64 input) copy of a chunk of logits, divided by the temperature."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(dtype, copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


class _ChunkedLogProbs(torch.autograd.Function):
    """Forward: per chunk, z = logits / t in float32, lse = logsumexp(z), log p(target) = z[target] - lse, entropy
    H = -sum p log p. Saved: the logits (the caller's tensor, not a copy) and [B, T] statistics. Backward: per chunk,
    recompute log p = z - lse; d log p(target) / dz = (onehot - p) / t; dH / dz = -p (log p + H) / t."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, chunk: int, with_entropy: bool):
        rows, cols = logits.shape[:2]
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        log_probs = torch.empty((rows, cols), dtype=dtype, device=logits.device)
        lse, entropy = torch.empty_like(log_probs), torch.empty_like(log_probs) if with_entropy else None
        for idx in _blocks(rows, cols, chunk):
            z = _work_copy(logits[idx], temperature)
            lse[idx] = torch.logsumexp(z, dim=-1)
            log_probs[idx] = z.gather(-1, targets[idx].unsqueeze(-1)).squeeze(-1) - lse[idx]
            if with_entropy:
                logp = z.sub_(lse[idx].unsqueeze(-1))
                entropy[idx] = -(logp.exp() * logp).sum(-1)
            del z
        ctx.set_materialize_grads(False)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.save_for_backward(logits, targets, lse, entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        logits, targets, lse, entropy = ctx.saved_tensors
        if grad_lp is None and grad_ent is None:
            return None, None, None, None, None
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)  # every block is written below
        for idx in _blocks(*logits.shape[:2], ctx.chunk):
            logp = _work_copy(logits[idx], ctx.temperature).sub_(lse[idx].unsqueeze(-1))
            p = logp.exp()
            if grad_ent is not None:  # -p (log p + H) g_H, built in logp's buffer
                g = logp.add_(entropy[idx].unsqueeze(-1)).mul_(p).mul_(-grad_ent[idx].unsqueeze(-1))
                if grad_lp is not None:
                    g.sub_(p.mul_(grad_lp[idx].unsqueeze(-1)))
            else:
                del logp
                g = p.mul_(-grad_lp[idx].unsqueeze(-1))
            if grad_lp is not None:
                g.scatter_add_(-1, targets[idx].unsqueeze(-1), grad_lp[idx].unsqueeze(-1).to(g.dtype))
            if ctx.temperature != 1.0:
                g.div_(ctx.temperature)
            grad[idx] = g
            del g, p
        return grad, None, None, None, None
