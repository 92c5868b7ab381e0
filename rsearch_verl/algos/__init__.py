"""RL algorithm functions: advantage estimators, policy/value/KL losses, KL penalties — pure, mask-aware tensor code.

Everything here is called by name from the config (`algorithm.adv_estimator`, `algorithm.kl_penalty`,
`actor.loss_agg_mode`, ...) and wraps verl's `core_algos` where it already does the job. See each module:
    advantages.py  ADVANTAGE_ESTIMATORS, compute_advantage, scores_to_token_rewards
    losses.py      agg_loss, agg_denominator, policy_loss, value_loss, entropy_from_logits, kl_loss
    kl.py          kl_estimate, apply_kl_penalty, kl_coef_at
"""

from rsearch_verl.algos.advantages import ADVANTAGE_ESTIMATORS, compute_advantage, scores_to_token_rewards
from rsearch_verl.algos.kl import apply_kl_penalty, kl_coef_at, kl_estimate
from rsearch_verl.algos.losses import (
    LOSS_AGG_MODES,
    agg_denominator,
    agg_loss,
    entropy_from_logits,
    kl_loss,
    policy_loss,
    value_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LOSS_AGG_MODES",
    "agg_denominator",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "entropy_from_logits",
    "kl_coef_at",
    "kl_estimate",
    "kl_loss",
    "policy_loss",
    "scores_to_token_rewards",
    "value_loss",
]
