"""Sequence packing (remove padding) and micro-batches formed by a token budget, for the actor's and the critic's
forward passes (`actor.use_remove_padding`, `actor.use_dynamic_bsz` + `actor.ppo_max_token_len_per_gpu`, the same
keys under `critic.`; verl's names).

Remove padding: the rows of a micro-batch [b, S] become one row [1, T] of their real tokens (T = attention_mask.sum())
whose position ids restart at 0 at every sequence. transformers' decoders (Qwen2, Llama / SmolLM2, ...) read those
restarts as sequence boundaries when they get `attention_mask=None` and no KV cache: SDPA and eager attention build a
block-diagonal causal mask from them, `flash_attention_2` calls flash-attn's varlen kernel with `cu_seqlens` taken
from them. The same call therefore serves CPU (SDPA) and GPU (flash-attn). Each sequence sees exactly its own tokens
at its own positions, so outputs equal the padded path's up to floating-point summation order.
`check_remove_padding` verifies that on the actual model at start-up (a model class without that support fails loudly).

Token budget: rows are split into micro-batches whose real tokens add up to at most the budget, balanced with verl's
Karmarkar-Karp partitioner; every data-parallel rank uses the same number of micro-batches (FSDP's collectives need
it). The loss denominator is global to the mini-batch (rsearch_verl/workers/forward.py), so any grouping of the rows
gives the same loss.

Usage:
    micros, order = micro_batches(data, micro_batch_size=2, max_token_len=4096)   # order: None = rows in place
    out = restore_order(torch.cat([f(m) for m in micros]), order)
    packed = PackedRows.from_padded(input_ids, attention_mask, position_ids)
    out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None, use_cache=False)
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from verl import DataProto
from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions


@dataclasses.dataclass
class PackedRows:
    """The real tokens of a padded [b, S] batch as one row, and where each came from."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 for every sequence
    flat: torch.Tensor  # [T] index of each packed token in the flattened [b * S] batch
    shape: tuple[int, int]  # (b, S)

    @classmethod
    def from_padded(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        flat = attention_mask.flatten().nonzero().squeeze(-1)
        return cls(
            input_ids=input_ids.flatten()[flat][None],
            position_ids=position_ids.flatten()[flat][None],
            flat=flat,
            shape=tuple(input_ids.shape),
        )

    def window(self, start: int, length: int) -> torch.Tensor:
        """Indices (into the packed row) of the tokens in padded columns start … start+length-1."""
        col = self.flat % self.shape[1]
        return ((col >= start) & (col < start + length)).nonzero().squeeze(-1)

    def scatter(self, values: torch.Tensor, keep: torch.Tensor, start: int, length: int) -> torch.Tensor:
        """[N] values of the packed tokens `keep` (from `window(start, length)`) -> [b, length], 0 on padding."""
        b, s = self.shape
        flat = self.flat[keep]
        dest = (flat // s) * length + (flat % s - start)
        out = values.new_zeros(b * length)
        return out.index_put((dest,), values).view(b, length)


def _dp_max(value: int, device: torch.device) -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def token_budget_partitions(seqlens: list[int], budget: int, device: torch.device) -> list[list[int]]:
    """Row indices per micro-batch: each micro-batch's tokens <= `budget`, the same count on every DP rank."""

    # a rank fails only after every rank knows (a lone raise would leave the others waiting in a collective)
    longest = _dp_max(max(seqlens), device)
    if longest > budget:
        raise ValueError(f"a sequence of {longest} tokens exceeds the micro-batch token budget {budget}")
    k = min(len(seqlens), math.ceil(sum(seqlens) / budget))
    while True:
        k = _dp_max(k, device)  # k <= rows on every rank: each rank holds the same number of rows
        parts = get_seqlen_balanced_partitions(seqlens, k, equal_size=False)
        over = int(any(sum(seqlens[i] for i in p) > budget for p in parts))
        if not _dp_max(over, device):
            return parts
        k += 1  # Karmarkar-Karp balances sums; with more parts every one fits (k = rows always does)


def micro_batches(
    data: DataProto, micro_batch_size: int, max_token_len: int | None, device: torch.device | None = None
) -> tuple[list[DataProto], list[int] | None]:
    """Micro-batches of `data`: consecutive slices of `micro_batch_size` rows, or (max_token_len set) the token
    budget's partitions plus the row order they concatenate to (for `restore_order`)."""
    if max_token_len is None:
        return [data[i : i + micro_batch_size] for i in range(0, len(data), micro_batch_size)], None
    seqlens = data.batch["attention_mask"].sum(-1).tolist()
    parts = token_budget_partitions(seqlens, max_token_len, device or torch.device("cpu"))
    return [data[p] for p in parts], [i for p in parts for i in p]


def restore_order(values: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    """Rows concatenated in micro-batch order -> the batch's own row order."""
    if order is None:
        return values
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return values[inverse]
