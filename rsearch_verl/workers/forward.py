"""Forward passes the workers share: per-token log-probs (and entropy) of the response under a causal LM, values
under a value model, and the micro-batch / loss-denominator bookkeeping of a data-parallel update.

Shapes follow rsearch_verl/batch.py: input_ids [B, P+R]; the logits at position t predict token t+1, so the
response's log-probs come from positions P-1 … P+R-2 (the same alignment verl uses).

Usage (inside a worker):
    log_probs, entropy = response_log_probs(model, micro, with_entropy=True)   # [b, R] each
    values = response_values(value_model, micro)                              # [b, R]
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from verl import DataProto

from rsearch_verl.algos.losses import agg_denominator
from rsearch_verl.algos.losses import entropy_from_logits as _entropy


def _model_inputs(data: DataProto, device: torch.device) -> dict[str, torch.Tensor]:
    t = data.batch
    return {
        "input_ids": t["input_ids"].to(device),
        "attention_mask": t["attention_mask"].to(device),
        "position_ids": t["position_ids"].to(device),
    }


def response_log_probs(
    model: torch.nn.Module, data: DataProto, device: torch.device, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token) [b, R] (float32) and optionally the entropy of each position's distribution, under
    the distribution the rollout sampled from: logits / `meta_info["temperature"]` (as verl's actor does; 1 when
    absent), so old, new and reference log-probs and the engine's own all describe the same policy."""
    resp_len = data.batch["responses"].shape[1]
    out = model(**_model_inputs(data, device), use_cache=False)
    logits = out.logits[:, -resp_len - 1 : -1, :].float()
    temperature = float(data.meta_info.get("temperature", 1.0))
    if temperature <= 0:
        raise ValueError(f"response_log_probs: temperature must be > 0 for training, got {temperature}")
    if temperature != 1.0:
        logits = logits / temperature
    targets = data.batch["responses"].to(device)
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = _entropy(logits) if with_entropy else None
    return log_probs, entropy


def response_values(value_model: torch.nn.Module, data: DataProto, device: torch.device) -> torch.Tensor:
    """V(state before each response token) [b, R] from a `ValueModel` (rsearch_verl/workers/critic.py)."""
    resp_len = data.batch["responses"].shape[1]
    values = value_model(**_model_inputs(data, device))
    return values[:, -resp_len - 1 : -1].float()


def split_rows(data: DataProto, size: int) -> list[DataProto]:
    """Consecutive row slices of at most `size` rows (the last may be shorter)."""
    return [data[i : i + size] for i in range(0, len(data), size)]


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
