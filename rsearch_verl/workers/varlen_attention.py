"""Variable-length ("varlen") SDPA: the CPU counterpart of flash-attn's varlen kernel for packed sequences, registered
with transformers' `AttentionInterface` as `varlen_sdpa`, and the choice of attention kernel for training copies.

transformers' own packed-sequence support with SDPA builds one dense [T, T] block-diagonal mask for a packed row of T
tokens: compute and memory grow with T^2, so a packed micro-batch of many sequences costs more attention than the
padded one. `varlen_sdpa` instead cuts the packed row at its position-id restarts and runs
`torch.nn.functional.scaled_dot_product_attention(is_causal=True)` per sequence: sum(L_i^2), no mask at all. Given a
padding mask (the padded path) it defers to transformers' SDPA unchanged, so one model serves both paths.

`configure_attention` picks the kernel of the training copies (actor, reference, critic): `model.attn_implementation`
when set (e.g. `flash_attention_2` on GPU, whose varlen kernel reads the same position ids), else `varlen_sdpa` when
remove padding is on, else transformers' default. The rollout engines keep their own copies on the default kernel.

Usage:
    configure_attention(model, cfg.model, remove_padding=cfg.actor.use_remove_padding)   # before wrapping/sharding
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

VARLEN_SDPA = "varlen_sdpa"

# The bounds of the last packed row seen: every layer of one forward (and its checkpointed recompute) gets the same
# position-ids tensor, so they are read back from the device once per forward, not once per layer (on a GPU each
# read is a device -> host sync). Keyed by the tensor object itself (a weak reference) and its in-place version.
_last_bounds: list = [None, -1, []]


def sequence_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of each sequence in a packed [1, T] row: a new one starts wherever the position is not the
    previous one + 1 (the rule transformers' packed-sequence detection uses)."""
    ref, version, bounds = _last_bounds
    if ref is not None and ref() is position_ids and version == position_ids._version:
        return bounds
    pos = position_ids[0]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    idx = starts.nonzero().squeeze(-1).tolist()
    bounds = list(zip(idx, idx[1:] + [pos.shape[0]], strict=True))
    _last_bounds[:] = [weakref.ref(position_ids), position_ids._version, bounds]
    return bounds


def varlen_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention-function signature: query [b, H, T, D], key / value [b, Hkv, T, D]."""
    # heavy: transformers kept out of this torch-only module's import
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[0] != 1 or kwargs.get("past_key_values"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(
            "varlen_sdpa: sliding-window attention is not supported; set model.attn_implementation"
        )
    gqa = query.shape[1] != key.shape[1]
    outputs = [
        F.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            dropout_p=dropout if module.training else 0.0,
            scale=scaling,
            is_causal=True,
            enable_gqa=gqa,
        )
        for s, e in sequence_bounds(position_ids)
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def varlen_sdpa_mask(*args, attention_mask=None, **kwargs):
    """The mask builder registered with `varlen_sdpa`: no mask for unpadded / packed input (the attention function
    reads the position ids), transformers' SDPA mask when a padding mask is given."""
    # heavy: transformers kept out of this torch-only module's import
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_varlen_sdpa() -> None:
    # heavy: transformers kept out of this torch-only module's import
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_forward)
    AttentionMaskInterface.register(VARLEN_SDPA, varlen_sdpa_mask)


def configure_attention(model: torch.nn.Module, model_cfg, remove_padding: bool) -> None:
    """Set the attention kernel of a training copy (see the module docstring)."""
    name = model_cfg.attn_implementation
    if name is None and remove_padding:
        register_varlen_sdpa()
        name = VARLEN_SDPA
    if name is not None:
        model.set_attn_implementation(name)
