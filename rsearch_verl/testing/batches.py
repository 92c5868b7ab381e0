"""Update batches for tests and benchmarks: the rollout's sequence keys (rsearch_verl/batch.py), spelled once."""

from __future__ import annotations

import torch


def sequence_tensors(
    prompts: torch.Tensor, responses: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The sequence keys a rollout hands the update, from prompt ids [B, P], response ids [B, R], the attention mask
    [B, P+R] and the response mask [B, R]; `loss_mask` as the driver writes it with observations masked."""
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "loss_mask": response_mask.clone(),
    }
