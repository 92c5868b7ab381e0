"""Update batches for tests and benchmarks: the rollout's sequence keys (rsearch_verl/batch.py `sequence_keys`) plus the
`loss_mask` the driver writes."""

from __future__ import annotations

import torch

from rsearch_verl.batch import sequence_keys


def sequence_tensors(
    prompts: torch.Tensor, responses: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The sequence keys a rollout hands the update, from prompt ids [B, P], response ids [B, R], the attention mask
    [B, P+R] and the response mask [B, R]; `loss_mask` as the driver writes it with observations masked."""
    return {**sequence_keys(prompts, responses, attention_mask, response_mask), "loss_mask": response_mask.clone()}
