"""Forward passes the workers share: per-token log-probs (and entropy) of the response under a causal LM, values
under a value model, and the micro-batch / loss-denominator bookkeeping of a data-parallel update.

Shapes follow rsearch_verl/batch.py: input_ids [B, P+R]; the logits at position t predict token t+1, so the
response's log-probs come from positions P-1 … P+R-2 (the same alignment verl uses).

The LM head runs only on the positions that predict a response token (`logits_to_keep`). With `remove_padding=True`
the same quantities come from one packed forward over the micro-batch's real tokens (rsearch_verl/workers/packing.py)
and are scattered back to [b, R] (0 on padding).

Log-probs and entropy come from those logits (model.dtype, e.g. bf16) `chunk_size` positions at a time in float32
(rsearch_verl/workers/logprobs.py): no float32 [b, R, V] tensor exists in the forward or the backward.

Usage (inside a worker):
    log_probs, entropy = response_log_probs(model, micro, device, with_entropy=True, chunk_size=1024)   # [b, R] each
    values = response_values(value_model, micro, device, remove_padding=True)         # [b, R]
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from verl import DataProto

from rsearch_verl.algos.losses import agg_denominator
from rsearch_verl.model_families import is_hybrid
from rsearch_verl.workers.logprobs import DEFAULT_CHUNK, chunked_log_probs
from rsearch_verl.workers.packing import PackedRows


def _hybrid(model: torch.nn.Module) -> bool:
    """Whether `model` (a CausalLM, a LoRA wrapper of one, or the critic's ValueModel) has recurrent layers."""
    for module in (model, getattr(model, "model", None)):
        config = getattr(module, "config", None)
        if config is not None:
            return is_hybrid(config)
    return False


def _model_inputs(data: DataProto, device: torch.device, trim: bool = False) -> dict[str, torch.Tensor]:
    """The padded forward's inputs; `trim` (hybrid models): without the columns that are padding in every row. A lone
    left-padded row must not keep them: transformers zeroes padding before a hybrid's linear-attention layers
    (Qwen3.5's Gated DeltaNet) only in batches of two or more rows, so one row would carry its pads into the recurrent
    state (tests/workers/test_workers_hybrid.py). Attention-only models keep the batch's shape (their numerics as
    before). Right padding follows every real token (causality keeps it out); the response slices count from the end."""
    t = data.batch
    used = t["attention_mask"].any(0).nonzero() if trim else []
    first = int(used[0]) if len(used) else 0
    return {key: t[key][:, first:].to(device) for key in ("input_ids", "attention_mask", "position_ids")}


def _packed(data: DataProto, device: torch.device) -> tuple[PackedRows, torch.Tensor, int]:
    """The micro-batch's real tokens as one row, and the packed indices of the positions that predict (or hold the
    state before) a response token: padded columns S-R-1 … S-2, as in the padded path's slice."""
    inputs = _model_inputs(data, device, trim=False)  # packing drops every pad itself; indices are the batch's own
    packed = PackedRows.from_padded(inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"])
    start = inputs["input_ids"].shape[1] - data.batch["responses"].shape[1] - 1
    return packed, packed.window(start, data.batch["responses"].shape[1]), start


def _response_logits(model, data: DataProto, device: torch.device, remove_padding: bool):
    """(logits [..., V] at the response-predicting positions, their target ids [...], a function placing [...] values
    into [b, R]). Padded: [b, R] as they are. Packed: [N] real positions only (the LM head runs on those alone)."""
    resp_len = data.batch["responses"].shape[1]
    if not remove_padding:
        # the head only on the last R + 1 positions: the prompt's logits are never needed
        out = model(**_model_inputs(data, device, _hybrid(model)), use_cache=False, logits_to_keep=resp_len + 1)
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


def response_values(
    value_model: torch.nn.Module, data: DataProto, device: torch.device, remove_padding: bool = False
) -> torch.Tensor:
    """V(state before each response token) [b, R] from a `ValueModel` (rsearch_verl/workers/critic.py)."""
    resp_len = data.batch["responses"].shape[1]
    if not remove_padding:
        values = value_model(**_model_inputs(data, device, _hybrid(value_model)))
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
    """Fail loudly when this model's packed forward lets sequences see each other (a model class whose attention
    ignores position-id restarts would do so silently). Collective under FSDP: every rank calls it. Two rows of
    random tokens. In float32 the packed forward must equal the padded one (tolerance 1e-3). In a lower compute
    `dtype` the two paths differ by rounding alone by up to ~0.2 in a 30-layer model (SmolLM2 in bfloat16), as much
    as cross-talk would move them, so there the check is isolation: changing the first sequence's tokens must leave
    the second one's outputs as they were (same shapes, same kernels: equal up to 1e-3; cross-talk moves them by
    ~0.1-1)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (2, 12), generator=g)
    attn = torch.ones(2, 12, dtype=torch.long)
    attn[0, :3] = 0  # left padding
    attn[1, -4:] = 0  # right padding
    fn = response_values if values else (lambda *a, **k: response_log_probs(*a, **k)[0])

    def run(input_ids: torch.Tensor, remove_padding: bool) -> torch.Tensor:
        tensors = {"input_ids": input_ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0)}
        tensors["responses"] = input_ids[:, 6:]
        return fn(model, DataProto.from_dict(tensors=tensors), device, remove_padding=remove_padding).cpu()

    was_training = model.training
    model.eval()
    mask = attn[:, 6:].bool()
    if dtype == torch.float32:
        gap = float((run(ids, False) - run(ids, True)).abs()[mask].max())
        what = "differs from the padded one"
    else:
        other = ids.clone()
        other[0] = torch.randint(0, vocab_size, (12,), generator=g)
        second = (run(ids, True) - run(other, True))[1].abs()
        gap = float(second[mask[1]].max())
        what = "changes one sequence's outputs with another's tokens"
    model.train(was_training)
    if not gap <= 1e-3:  # NaN fails too
        raise RuntimeError(
            f"use_remove_padding: the packed forward of {type(model).__name__} {what} by {gap:.3g} (its attention "
            "does not treat position-id restarts as sequence boundaries); turn remove padding off"
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
