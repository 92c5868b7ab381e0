"""KL estimators between the policy and the reference model, the in-reward KL penalty and the β schedule.

All functions are pure tensor functions. Shapes: B trajectories, R response tokens. `mask` is the loss mask
([B, R], 1 = policy token): observation and padding tokens carry no KL.

Estimators (J. Schulman, "Approximating KL divergence"; r = log_prob - ref_log_prob):
    k1 / "kl"         r
    abs               |r|
    k2 / mse          0.5 * r²
    k3 / low_var_kl   exp(-r) + r - 1, clamped exactly like verl (inner ±20, result ±10)

Usage:
    kl = kl_estimate(log_prob, ref_log_prob, "k3")                 # [B, R] elementwise
    rewards, metrics = apply_kl_penalty(scores, old_lp, ref_lp, mask, beta=0.001, kind="k1")
    beta = kl_coef_at(step, total_steps, start=1e-3, end=0.0, schedule="linear")
"""

from __future__ import annotations

import torch
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F

# our name -> the name verl's `kl_penalty_forward` understands
KL_KINDS: dict[str, str] = {
    "k1": "k1",
    "kl": "k1",
    "abs": "abs",
    "k2": "k2",
    "mse": "mse",
    "k3": "low_var_kl",
    "low_var_kl": "low_var_kl",
}
KL_SCHEDULES = ("constant", "linear")


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Elementwise KL estimate of the policy from the reference, same shape as the inputs ([B, R]).

    Raises ValueError for an unknown `kind` (the message lists the known ones).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {sorted(KL_KINDS)}")
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(f"log_prob {tuple(log_prob.shape)} and ref_log_prob {tuple(ref_log_prob.shape)} differ")
    return core_algos.kl_penalty_forward(log_prob, ref_log_prob, KL_KINDS[kind])


def masked_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is 1; 0 when the mask is empty (never NaN)."""
    mask = mask.to(values.dtype)
    total = mask.sum()
    # torch.where so a NaN/inf at a masked position cannot leak into the sum
    masked_sum = torch.where(mask.bool(), values, torch.zeros_like(values)).sum()
    return masked_sum / total.clamp(min=1.0)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float,
    kind: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token rewards with the KL penalty folded in: `scores - beta * kl * mask` ([B, R]).

    Returns (token_level_rewards [B, R], {"actor/reward_kl": ...}): the metric is verl's `current_kl`, the batch
    mean of each trajectory's mean KL over its policy tokens (a trajectory without one counts as 0, as in verl).
    """
    kl = kl_estimate(old_log_probs, ref_log_prob, kind)
    mask_f = mask.to(kl.dtype)
    kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    rewards = token_level_scores - beta * kl * mask_f
    per_seq = verl_F.masked_mean(kl, mask_f, axis=-1)
    return rewards, {"actor/reward_kl": float(per_seq.mean())}


def kl_coef_at(step: int, total_steps: int, *, start: float, end: float, schedule: str) -> float:
    """β at `step`: `constant` -> start; `linear` -> start + (end - start) * min(step / total_steps, 1)."""
    if schedule == "constant":
        return float(start)
    if schedule == "linear":
        if total_steps <= 0:
            raise ValueError(f"linear KL schedule needs total_steps > 0, got {total_steps}")
        frac = min(max(step, 0) / total_steps, 1.0)
        return float(start + (end - start) * frac)
    raise ValueError(f"unknown KL schedule {schedule!r}; known: {list(KL_SCHEDULES)}")
