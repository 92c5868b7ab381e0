"""Forward passes the workers share: per-token log-probs (and entropy) of the response under a causal LM, values
under a value model, and the micro-batch / loss-denominator bookkeeping of a data-parallel update.

Shapes follow rsearch_verl/batch.py: input_ids [B, P+R]; the logits at position t predict token t+1, so the
response's log-probs come from positions P-1 … P+R-2 (the same alignment verl uses).

The LM head runs only on the positions that predict a response token (`logits_to_keep`). With `remove_padding=True`
the same quantities come from one packed forward over the micro-batch's real tokens (rsearch_verl/workers/packing.py)
and are scattered back to [b, R] (0 on padding).

Log-probs and entropy come from those logits (model.dtype, e.g. bf16) `chunk_size` positions at a time in float32
(`chunked_log_probs`, an autograd Function): no float32 [b, R, V] tensor exists in the forward or the backward, which
recomputes each chunk's softmax. With a 152k vocabulary that is 0.6 MB per position that is never allocated (numbers:
benchmarks/logprob_memory.py, docs/architecture.md).

Usage (inside a worker):
    log_probs, entropy = response_log_probs(model, micro, device, with_entropy=True, chunk_size=1024)   # [b, R] each
    values = response_values(value_model, micro, device, remove_padding=True)         # [b, R]
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from verl import DataProto

from rsearch_verl.algos.losses import agg_denominator
from rsearch_verl.workers.packing import PackedRows

DEFAULT_CHUNK = 1024  # as actor.logprob_chunk_size (rsearch_verl/config.py)


def _model_inputs(data: DataProto, device: torch.device) -> dict[str, torch.Tensor]:
    t = data.batch
    return {
        "input_ids": t["input_ids"].to(device),
        "attention_mask": t["attention_mask"].to(device),
        "position_ids": t["position_ids"].to(device),
    }


def _packed(data: DataProto, device: torch.device) -> tuple[PackedRows, torch.Tensor, int]:
    """The micro-batch's real tokens as one row, and the packed indices of the positions that predict (or hold the
    state before) a response token: padded columns S-R-1 … S-2, as in the padded path's slice."""
    inputs = _model_inputs(data, device)
    packed = PackedRows.from_padded(inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"])
    start = inputs["input_ids"].shape[1] - data.batch["responses"].shape[1] - 1
    return packed, packed.window(start, data.batch["responses"].shape[1]), start


def _response_logits(model, data: DataProto, device: torch.device, remove_padding: bool):
    """(logits [..., V] at the response-predicting positions, their target ids [...], a function placing [...] values
    into [b, R]). Padded: [b, R] as they are. Packed: [N] real positions only (the LM head runs on those alone)."""
    resp_len = data.batch["responses"].shape[1]
    if not remove_padding:
        # the head only on the last R + 1 positions: the prompt's logits are never needed
        out = model(**_model_inputs(data, device), use_cache=False, logits_to_keep=resp_len + 1)
        return out.logits[:, :-1, :], data.batch["responses"].to(device), lambda x: x
    packed, keep, start = _packed(data, device)
    out = model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=None,  # with no mask (and no cache) the position-id restarts are the sequence boundaries
        use_cache=False,
        logits_to_keep=keep,
    )
    # the target of padded column c is column c + 1 of the same row (c <= S-2 inside the window)
    targets = data.batch["input_ids"].to(device).flatten()[packed.flat[keep] + 1]
    return out.logits[0], targets, lambda x: packed.scatter(x, keep, start, resp_len)


def response_log_probs(
    model: torch.nn.Module,
    data: DataProto,
    device: torch.device,
    with_entropy: bool = False,
    remove_padding: bool = False,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token) [b, R] (float32) and optionally the entropy of each position's distribution, under
    the distribution the rollout sampled from: logits / `meta_info["temperature"]` (as verl's actor does; 1 when
    absent), so old, new and reference log-probs and the engine's own all describe the same policy.
    `remove_padding`: one packed forward over the real tokens (rsearch_verl/workers/packing.py); 0 on padding.
    `chunk_size`: positions per float32 chunk (`chunked_log_probs`)."""
    temperature = float(data.meta_info.get("temperature", 1.0))
    if temperature <= 0:
        raise ValueError(f"response_log_probs: temperature must be > 0 for training, got {temperature}")
    logits, targets, place = _response_logits(model, data, device, remove_padding)
    log_probs, entropy = chunked_log_probs(logits, targets, temperature, chunk_size, with_entropy)
    return place(log_probs), (place(entropy) if with_entropy else None)


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


def response_values(
    value_model: torch.nn.Module, data: DataProto, device: torch.device, remove_padding: bool = False
) -> torch.Tensor:
    """V(state before each response token) [b, R] from a `ValueModel` (rsearch_verl/workers/critic.py)."""
    resp_len = data.batch["responses"].shape[1]
    if not remove_padding:
        values = value_model(**_model_inputs(data, device))
        return values[:, -resp_len - 1 : -1].float()
    packed, keep, start = _packed(data, device)
    values = value_model(input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids)
    return packed.scatter(values[0, keep].float(), keep, start, resp_len)


@torch.no_grad()
def check_remove_padding(
    model: torch.nn.Module,
    device: torch.device,
    vocab_size: int,
    values: bool = False,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Fail loudly when this model's packed forward differs from its padded one (a model class whose attention
    ignores position-id restarts would silently let sequences attend to each other). Collective under FSDP: every
    rank calls it. Two padded rows of random tokens; tolerance 1e-3 when the compute `dtype` is float32, 5e-2 in
    bf16 (cross-talk moves outputs by ~0.1-1)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, 12), generator=g)
    attn = torch.ones(2, 12, dtype=torch.long)
    attn[0, :3] = 0  # left padding
    attn[1, -4:] = 0  # right padding
    tensors = {"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0)}
    tensors["responses"] = ids[:, 6:]
    data = DataProto.from_dict(tensors=tensors)
    fn = response_values if values else (lambda *a, **k: response_log_probs(*a, **k)[0])
    was_training = model.training
    model.eval()
    padded, packed = fn(model, data, device).cpu(), fn(model, data, device, remove_padding=True).cpu()
    model.train(was_training)
    mask = attn[:, 6:].bool()
    gap = float((padded - packed).abs()[mask].max())
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    if not gap <= tol:  # NaN fails too
        raise RuntimeError(
            f"use_remove_padding: the packed forward of {type(model).__name__} differs from the padded one by {gap:.3g}"
            " (its attention does not treat position-id restarts as sequence boundaries); turn remove padding off"
        )


def global_denominator(mask: torch.Tensor, mode: str, device: torch.device) -> float:
    """The loss denominator of a whole mini-batch: the local count of `agg_denominator`, summed over ranks."""
    count = torch.tensor([agg_denominator(mask, mode)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(count)
    return max(float(count.item()), 1.0)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in rows for k in r})
    return {k: sum(r[k] for r in rows if k in r) / max(1, sum(k in r for r in rows)) for k in keys}
