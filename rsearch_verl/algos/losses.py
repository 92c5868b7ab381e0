"""Loss functions of the actor and critic updates: clipped PPO policy loss (with dual-clip), clipped value loss,
entropy and the KL loss, plus the loss aggregation modes.

Pure tensor functions. Shapes: B trajectories, R response tokens, V vocabulary. `mask` is the loss mask [B, R]
(1 = policy token; observations and padding are 0 and contribute nothing to any loss, metric or gradient).
Aggregation modes (`LOSS_AGG_MODES`):
    token-mean            sum over all policy tokens / number of policy tokens
    seq-mean-token-mean   mean over rows (that have a policy token) of the per-row token mean
    seq-mean-token-sum    mean over rows (that have a policy token) of the per-row token sum
    seq-mean-token-sum-norm   seq-mean-token-sum / `loss_scale_factor` (a constant: the generation budget), the
                          Dr.GRPO aggregation ("Understanding R1-Zero-Like Training"): no per-sequence length
                          normalisation, so long and short answers weigh by their tokens
These delegate to verl's `core_algos.agg_loss`; a mask with no token at all gives a loss of exactly 0.
Every loss takes an optional `denominator` (the global count from `agg_denominator`, summed over micro-batches and
ranks): then the sum of the micro-batch losses equals the loss of the whole mini-batch, whatever the split.

Usage (inside a worker's update step):
    loss, m = policy_loss(old_log_prob, log_prob, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                          clip_ratio_c=3.0, loss_agg_mode="token-mean")
    loss = loss - entropy_coeff * agg_loss(entropy_from_logits(logits), mask, "token-mean")
    if use_kl_loss:
        kl, _ = kl_loss(log_prob, ref_log_prob, mask, "low_var_kl", "token-mean")
        loss = loss + kl_coef * kl
"""

from __future__ import annotations

import torch
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F

from rsearch_verl import signals as sig
from rsearch_verl.algos.kl import kl_estimate, masked_token_mean

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shape mismatch: {shapes}")


def agg_denominator(mask: torch.Tensor, mode: str) -> float:
    """The local count a mode divides by: policy tokens (token-mean) or rows with a policy token (seq-mean-*).

    Data-parallel workers all-reduce (sum) this over ranks / micro-batches and pass it back as `denominator`, so
    the per-rank losses add up to the loss of the whole mini-batch.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {list(LOSS_AGG_MODES)}")
    if mode == "token-mean":
        return float(mask.sum())
    return float((mask.sum(dim=-1) > 0).sum())


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    denominator: float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a [B, R] per-token loss into a scalar (see the module docstring for the modes).

    `denominator` (optional) replaces the local count of `agg_denominator(mask, mode)`: pass the global count of a
    mini-batch split over micro-batches / ranks to get exactly the big-batch loss as a sum of the pieces.
    FSDP / DDP AVERAGE gradients over ranks, so a worker multiplies this loss by the world size (verl's `dp_size`)
    to make the reduced gradient that of the summed loss. `loss_scale_factor` is the constant of
    seq-mean-token-sum-norm (verl's: None there means the padded width of `mask`, which varies by micro-batch).
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {list(LOSS_AGG_MODES)}")
    _check_same_shape(loss_mat=loss_mat, mask=mask)
    if denominator is not None and not denominator > 0:
        raise ValueError(f"denominator must be > 0, got {denominator}")
    # masked entries become exact zeros (with zero gradient): an inf/NaN there would survive verl's `loss * mask`
    loss_mat = torch.where(mask.bool(), loss_mat, torch.zeros_like(loss_mat))
    mask = mask.to(loss_mat.dtype)
    # zero (not NaN) loss that stays in the graph when the micro-batch holds only observations/padding
    if not bool(mask.any()):
        return loss_mat.sum()
    return core_algos.agg_loss(
        loss_mat=loss_mat,
        loss_mask=mask,
        loss_agg_mode=mode,
        batch_num_tokens=denominator,
        global_batch_size=denominator,
        loss_scale_factor=loss_scale_factor,
    )


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    denominator: float | None = None,
    loss_scale_factor: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate `max(-A·ρ, -A·clip(ρ, 1-clip_ratio_low, 1+clip_ratio_high))`, all [B, R] inputs.

    Argument order is verl's (`old_log_prob` first). For A < 0 the loss is further capped at `-A·clip_ratio_c`
    (dual-clip PPO, arXiv:1912.09729); `clip_ratio_c=None` (or <= 1, the config's convention) turns dual-clip off.
    ρ = exp(log_prob - old_log_prob) with the log-ratio clamped to ±20 as in verl. `is_weights` [B, R] (off-policy
    correction, rsearch_verl/algos/off_policy.py) multiply each token's clipped loss, as verl's `rollout_is_weights`
    do. Returns (scalar loss, metrics
    "actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl").
    The maths is verl's `compute_policy_loss_vanilla` (tested equal); it is restated here because verl's version
    asserts dual-clip on, takes a verl ActorConfig, and lets a NaN at a masked position leak into the loss.
    """
    _check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, mask=response_mask)
    mask_f = response_mask.to(log_prob.dtype)
    valid = response_mask.bool()
    # masked positions get log-ratio 0 and advantage 0, so garbage there cannot reach values or gradients
    log_ratio = torch.where(valid, log_prob - old_log_prob, torch.zeros_like(log_prob))
    log_ratio = torch.clamp(log_ratio, min=-20.0, max=20.0)
    adv = torch.where(valid, advantages, torch.zeros_like(advantages))
    ratio = torch.exp(log_ratio)

    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    clipfrac = masked_token_mean(torch.gt(clipped, unclipped).to(mask_f.dtype), mask_f)
    clipfrac_lower = torch.zeros((), dtype=mask_f.dtype)
    if clip_ratio_c is not None and clip_ratio_c > 1.0:
        dual = -adv * clip_ratio_c
        lower_hit = torch.gt(losses, dual) & (adv < 0)
        clipfrac_lower = masked_token_mean(lower_hit.to(mask_f.dtype), mask_f)
        losses = torch.where(adv < 0, torch.minimum(losses, dual), losses)
    if is_weights is not None:
        _check_same_shape(losses=losses, is_weights=is_weights)
        losses = losses * is_weights.detach().to(losses.dtype)

    loss = agg_loss(losses, mask_f, loss_agg_mode, denominator=denominator, loss_scale_factor=loss_scale_factor)
    metrics = {
        sig.PG_LOSS: float(loss.detach()),
        "actor/pg_clipfrac": float(clipfrac),
        "actor/pg_clipfrac_lower": float(clipfrac_lower),
        "actor/ppo_kl": float(masked_token_mean(-log_ratio.detach(), mask_f)),
    }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    denominator: float | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss `0.5 * agg(max((v - G)², (clip(v, v_old ± cliprange_value) - G)²))` over [B, R] inputs.

    `values` are the critic's current predictions (with grad), `old_values` those of the rollout. Delegates to verl's
    `compute_value_loss`. Returns (scalar loss, metrics "critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean").
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=response_mask)
    if loss_agg_mode not in LOSS_AGG_MODES:  # verl accepts more modes than we support; keep one vocabulary
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known: {list(LOSS_AGG_MODES)}")
    mask_f = response_mask.to(values.dtype)
    valid = response_mask.bool()
    # replace masked entries with harmless values so their (unused) squares cannot be inf/NaN in backward
    old_values = torch.where(valid, old_values, values.detach())
    returns = torch.where(valid, returns, values.detach())
    if bool(valid.any()):
        loss, clipfrac = core_algos.compute_value_loss(
            vpreds=values,
            returns=returns,
            values=old_values,
            response_mask=mask_f,
            cliprange_value=cliprange_value,
            loss_agg_mode=loss_agg_mode,
            batch_num_tokens=denominator,
            global_batch_size=denominator,
            loss_scale_factor=loss_scale_factor,
        )
    else:
        loss, clipfrac = agg_loss(values * 0.0, mask_f, loss_agg_mode), torch.zeros(())
    metrics = {
        sig.VF_LOSS: float(loss.detach()),
        "critic/vf_clipfrac": float(clipfrac),
        "critic/vpred_mean": float(masked_token_mean(values.detach(), mask_f)),
    }
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution per position: logits [..., V] -> [...] (verl's stable formula)."""
    return verl_F.entropy_from_logits(logits)


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str,
    loss_agg_mode: str = "token-mean",
    *,
    denominator: float | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-to-reference loss (GRPO style): `agg(kl_estimate(log_prob, ref_log_prob, kind))` over policy tokens.

    Returns (scalar loss, {"actor/kl_loss": float}).
    """
    _check_same_shape(log_prob=log_prob, ref_log_prob=ref_log_prob, mask=response_mask)
    valid = response_mask.bool()
    # equal inputs at masked positions -> KL 0 there for every estimator, with a zero gradient
    ref_log_prob = torch.where(valid, ref_log_prob, log_prob.detach())
    kl = kl_estimate(log_prob, ref_log_prob, kind)
    mask_f = response_mask.to(kl.dtype)
    loss = agg_loss(kl, mask_f, loss_agg_mode, denominator=denominator, loss_scale_factor=loss_scale_factor)
    return loss, {sig.KL_LOSS: float(loss.detach())}
