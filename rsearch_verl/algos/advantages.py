"""Advantage estimators, registered by name, and the placement of outcome scores on tokens.

Pure tensor functions that wrap verl's `core_algos` (the same maths verl trains with), adding the guarantees
our multi-turn batches need. Shapes: B trajectories, R response tokens. `response_mask` [B, R] is the loss mask
(1 = token the policy sampled, 0 = observation inserted by the environment or padding):
    * advantages and returns are exactly 0 wherever the mask is 0;
    * rewards at mask-0 positions are ignored, and GAE / REINFORCE++ returns jump over masked spans (the value
      chain links each policy token to the next policy token, as if observations were cut out);
    * batches with fewer than 2 policy tokens (where whitening is undefined) give zero advantages, not NaN.
`index` [B] holds the group id (uid) of each row: rows of one prompt form one GRPO / RLOO group.
Folded trajectories (several rows each, `trajectory` / `last`): every estimator runs on the trajectories unfolded.

Estimators (`ADVANTAGE_ESTIMATORS`): gae (PPO, needs values), grpo, drgrpo (GRPO without the std division; also
registered as "dr_grpo"), rloo, reinforce_plus_plus, reinforce_plus_plus_baseline.

GAE over observation spans: verl 0.9.1's `compute_gae_advantage_return` already carries `nextvalues` and the running
GAE term unchanged through mask-0 positions, so the TD error of a policy token bootstraps from the value of the NEXT
POLICY token (observations are cut out of the chain, discounting counts policy tokens only). We call it directly; the
wrapper only zeroes values/rewards at masked positions first (a NaN there would otherwise survive `0 * v`) and zeroes
the outputs there. REINFORCE++ returns skip observations the same way (verl does that too).

Usage:
    token_rewards = scores_to_token_rewards(scores, response_mask)        # [B] -> [B, R]
    adv, ret = compute_advantage("grpo", token_level_rewards=token_rewards, response_mask=mask, index=uids)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each row's scalar score ([B]) on its LAST policy token (mask 1) of a [B, R] zero tensor.

    A row with no policy token gets all zeros.
    """
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores must be [B] and response_mask [B, R]; got {tuple(scores.shape)}, {tuple(response_mask.shape)}"
        )
    valid = response_mask.bool()
    positions = torch.arange(response_mask.shape[1], device=response_mask.device).expand_as(response_mask)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=-1).values  # -1 = no token
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] = scores[rows].to(rewards.dtype)
    return rewards


def _gae(rewards, mask, index, values, gamma, lam, **_):
    if values.shape != rewards.shape:
        raise ValueError(f"values {tuple(values.shape)} and token_level_rewards {tuple(rewards.shape)} differ")
    # masked values play no role in the maths; zeroing them keeps a NaN there from leaking through `0 * v`
    values = torch.where(mask.bool(), values.to(rewards.dtype), torch.zeros_like(rewards))
    return core_algos.compute_gae_advantage_return(rewards, values, mask, gamma, lam)


def _grpo(rewards, mask, index, norm_adv_by_std_in_grpo, **_):
    return core_algos.compute_grpo_outcome_advantage(
        rewards, mask, index, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo
    )


def _drgrpo(rewards, mask, index, **_):
    return core_algos.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)


def _rloo(rewards, mask, index, **_):
    return core_algos.compute_rloo_outcome_advantage(rewards, mask, index)


def _reinforce_pp(rewards, mask, index, gamma, **_):
    return core_algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=AlgoConfig(gamma=gamma))


def _reinforce_pp_baseline(rewards, mask, index, **_):
    return core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "gae": _gae,
    "grpo": _grpo,
    "drgrpo": _drgrpo,
    "dr_grpo": _drgrpo,  # the same, spelled as the Dr.GRPO paper
    "rloo": _rloo,
    "reinforce_plus_plus": _reinforce_pp,
    "reinforce_plus_plus_baseline": _reinforce_pp_baseline,
}
# these compare the samples of one prompt: a group needs rollout.n >= 2
GROUP_ESTIMATORS = ("grpo", "drgrpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
# these whiten over all policy tokens of the batch (verl's masked_whiten needs >= 2 of them)
_WHITENED = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def compute_advantage(
    name: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | Any,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    trajectory: np.ndarray | None = None,
    last: np.ndarray | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ([B, R] each, float32, zero where `response_mask` is 0) of estimator `name`.

    `token_level_rewards` [B, R]; `index` [B] group ids; `values` [B, R] for "gae" only. Unknown name -> ValueError.
    `trajectory` [B] and `last` [B] bool (rows of folded trajectories, rsearch_verl/batch.py `rows_of_trajectories` and
    `last_rows`): row i belongs to the trajectory whose last row is the trajectory[i]-th row with `last`, and a
    trajectory's rows (in segment order) are pieces of ONE sequence: `token_level_rewards` then holds that sequence's
    rewards, split over its rows — the outcome once, on the last row's last policy token, and per-token terms (the
    in-reward KL penalty) on every row's tokens. Every estimator runs on the unfolded sequences (rows laid end to end)
    and each row gets its piece of the result, so a trajectory's advantages are those it would have unsplit: a group
    estimator scores the trajectory with the sum of all its rows' rewards (one sample of its group, never one per row),
    GAE's value chain and the returns run across folds, whitening sees every policy token once.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}")
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [B, R]"
        )
    if name == "gae" and values is None:
        raise ValueError("advantage estimator 'gae' needs critic values (values=None)")
    if len(index) != token_level_rewards.shape[0]:
        raise ValueError(f"index has {len(index)} entries for {token_level_rewards.shape[0]} rows")
    mask = response_mask.to(torch.float32)
    # rewards at observation/padding positions are not the policy's: drop them (they are 0 in normal batches)
    rewards = torch.where(mask.bool(), token_level_rewards.to(torch.float32), torch.zeros_like(mask))
    index = np.asarray(index, dtype=object)
    if trajectory is not None and not np.asarray(last, dtype=bool).all():
        kwargs = {"gamma": gamma, "lam": lam, "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo}
        return _unfolded(name, rewards, mask, index, values, trajectory, last, **kwargs)
    if name in _WHITENED and int(mask.sum()) < 2:
        return _degenerate(name, rewards, mask)
    with torch.no_grad():
        advantages, returns = ADVANTAGE_ESTIMATORS[name](
            rewards,
            mask,
            index=index,
            values=values,
            gamma=gamma,
            lam=lam,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        )
    return advantages * mask, returns * mask


def _unfolded(name, rewards, mask, index, values, trajectory, last, **kwargs):
    """Estimator `name` on folded trajectories (see `compute_advantage`): lay each trajectory's rows end to end, in
    batch order (the rollout writes them in segment order, rollout/trajectory.py), into one row of a [T, K*R] batch
    (T trajectories, K the most rows one has), run the estimator on those unfolded sequences, cut the result back."""
    owner = np.asarray(trajectory, dtype=np.int64)
    rank, seen = np.zeros(len(owner), dtype=np.int64), {}  # rank: the row's place within its trajectory
    for i, t in enumerate(owner.tolist()):
        rank[i] = seen[t] = seen.get(t, -1) + 1
    last = np.flatnonzero(np.asarray(last, dtype=bool))
    shape = (len(last), int(rank.max()) + 1, rewards.shape[1])
    at = (torch.as_tensor(owner), torch.as_tensor(rank))

    def unfold(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(shape)
        out[at] = x
        return out.view(shape[0], -1)

    adv, ret = compute_advantage(
        name,
        token_level_rewards=unfold(rewards),
        response_mask=unfold(mask),
        index=index[last],
        values=None if values is None else unfold(values.to(rewards.dtype)),
        **kwargs,
    )
    return adv.view(shape)[at], ret.view(shape)[at]


def _degenerate(name: str, rewards: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """< 2 policy tokens in the batch: whitening one value gives 0; the only return is that token's reward."""
    advantages = torch.zeros_like(rewards)
    returns = advantages if name == "reinforce_plus_plus_baseline" else rewards * mask
    return advantages, returns
