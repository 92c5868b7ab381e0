"""Folded trajectories in the update (rsearch_verl/rollout/context.py makes them several rows): the rows of a trajectory
share its outcome reward and advantage, a group estimator compares trajectories (never rows), every estimator gives a
split trajectory the advantages it has unsplit (the outcome once, the in-reward KL penalty of every row), token-mean
loss weights do not change when a trajectory is split, and `fit_rows` pads rows for the workers with no-loss copies.

Run: .venv/bin/python -m pytest -q tests/algos/test_algos_folded.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl import DataProto

from rsearch_verl.algos.advantages import ADVANTAGE_ESTIMATORS, compute_advantage, scores_to_token_rewards
from rsearch_verl.algos.losses import agg_loss
from rsearch_verl.batch import last_rows, rows_of_trajectories
from rsearch_verl.config import load_config
from rsearch_verl.trainer.phases import advantage_phase, fit_rows


def _split(mask_row: torch.Tensor, cuts: list[int]) -> list[torch.Tensor]:
    """A trajectory's response mask split at `cuts` into rows of the same width (zeros after each piece)."""
    rows, start = [], 0
    for end in [*cuts, int(mask_row.shape[0])]:
        row = torch.zeros_like(mask_row)
        row[: end - start] = mask_row[start:end]
        rows.append(row)
        start = end
    return rows


def _folded_batch(seed: int):
    """4 trajectories in 2 groups of 2; trajectory 1 split into 3 rows and trajectory 2 into 2."""
    gen = torch.Generator().manual_seed(seed)
    width = 10
    masks = (torch.rand(4, width, generator=gen) > 0.3).float()
    masks[:, 0] = 1
    scores = torch.randn(4, generator=gen)
    cuts = {0: [], 1: [3, 6], 2: [5], 3: []}
    rows, owner, last, uid = [], [], [], []
    for t in range(4):
        pieces = _split(masks[t], cuts[t])
        for k, piece in enumerate(pieces):
            rows.append(piece)
            owner.append(t)
            last.append(k == len(pieces) - 1)
            uid.append(f"g{t // 2}")
    mask = torch.stack(rows)
    row_scores = scores[torch.tensor(owner)]
    return masks, scores, mask, row_scores, np.array(owner), np.array(last), np.array(uid, dtype=object)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_advantage_is_the_trajectorys(name, seed):
    masks, scores, mask, row_scores, owner, last, uid = _folded_batch(seed)
    whole, _ = compute_advantage(
        name, token_level_rewards=scores_to_token_rewards(scores, masks), response_mask=masks,
        index=np.array(["g0", "g0", "g1", "g1"], dtype=object),
    )  # fmt: skip
    once = scores_to_token_rewards(row_scores * torch.as_tensor(last), mask)  # the outcome on the last row only
    adv, _ = compute_advantage(
        name, token_level_rewards=once, response_mask=mask, index=uid, trajectory=owner, last=last
    )  # fmt: skip
    per_traj = (whole * masks).sum(-1) / masks.sum(-1)
    for i, t in enumerate(owner):
        on = mask[i].bool()
        assert torch.allclose(adv[i][on], per_traj[t].expand(int(on.sum())), atol=1e-5)  # shared by every row
        assert torch.all(adv[i][~on] == 0)  # nothing outside the loss mask


def test_rows_without_folds_are_untouched():
    masks, scores, *_ = _folded_batch(0)
    index = np.array(["g0", "g0", "g1", "g1"], dtype=object)
    rewards = scores_to_token_rewards(scores, masks)
    plain, _ = compute_advantage("grpo", token_level_rewards=rewards, response_mask=masks, index=index)
    same, _ = compute_advantage(
        "grpo", token_level_rewards=rewards, response_mask=masks, index=index,
        trajectory=np.arange(4), last=np.ones(4, dtype=bool),
    )  # fmt: skip
    assert torch.equal(plain, same)


def test_token_mean_does_not_weigh_a_split_trajectory_more():
    masks, _, mask, _, owner, *_ = _folded_batch(3)
    gen = torch.Generator().manual_seed(4)
    per_token = torch.randn(masks.shape, generator=gen)
    rows = torch.stack([
        torch.cat([per_token[t][cut:], torch.zeros(cut)]) for t, cut in zip(owner, [0, 0, 3, 6, 0, 5, 0], strict=True)
    ])  # fmt: skip
    whole = agg_loss(per_token, masks, "token-mean")
    split = agg_loss(rows, mask, "token-mean")
    assert torch.allclose(whole, split, atol=1e-6)
    # the row-weighted mode would count trajectory 1 three times: validation refuses it with folding
    assert not torch.allclose(
        agg_loss(per_token, masks, "seq-mean-token-mean"), agg_loss(rows, mask, "seq-mean-token-mean")
    )


def _rows_batch(n_rows: int, last: list[bool]) -> DataProto:
    ids = [f"t{sum(last[:i])}" for i in range(n_rows)]
    return DataProto.from_dict(
        tensors={"loss_mask": torch.ones(n_rows, 4, dtype=torch.long), "responses": torch.zeros(n_rows, 4)},
        non_tensors={
            "uid": np.array(["u"] * n_rows, dtype=object),
            "traj_id": np.array(ids, dtype=object),
            "last_segment": np.array(last, dtype=object),
        },
    )


def test_fit_rows_pads_with_no_loss_copies():
    cfg = load_config(["+recipe=search_r1_grpo", "trainer=cpu2"])
    n_traj = cfg.data.train_batch_size * cfg.rollout.n
    last = []
    for t in range(n_traj):
        last += [False] * (t % 3) + [True]  # 0, 1 or 2 folds
    batch, metrics = fit_rows(_rows_batch(len(last), last), cfg)
    steps = batch.meta_info["mini_batches"]["actor"]
    assert steps == n_traj // cfg.actor.ppo_mini_batch_size
    assert len(batch) % (cfg.world_size * steps) == 0 and len(batch) >= len(last)
    pad = len(batch) - len(last)
    assert metrics["rollout/padding_rows"] == pad
    assert not batch.batch["loss_mask"][len(last) :].any()
    assert last_rows(batch.non_tensor_batch).sum() == n_traj  # the copies stand for no trajectory
    assert (rows_of_trajectories(batch.non_tensor_batch) < n_traj).all()
    plain = _rows_batch(n_traj, [True] * n_traj)
    same, none = fit_rows(plain, cfg)
    assert same is plain and none == {} and "mini_batches" not in same.meta_info


CUTS = {0: [], 1: [3, 6], 2: [5], 3: []}  # `_folded_batch`'s: trajectory 1 in 3 rows, trajectory 2 in 2


def _fold(whole: torch.Tensor) -> torch.Tensor:
    """Per-trajectory [4, R] values cut into `_folded_batch`'s rows (each piece at the front of its row)."""
    return torch.stack([piece for t in range(4) for piece in _split(whole[t], CUTS[t])])


def _kl_inputs(seed: int, masks: torch.Tensor):
    gen = torch.Generator().manual_seed(100 + seed)
    old, ref, values = (torch.randn(masks.shape, generator=gen) for _ in range(3))
    return old, ref, values


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("seed", [0, 1])
def test_every_estimator_sees_the_trajectory_unfolded(name, seed):
    """Per-token rewards (a KL penalty) on every policy token: each row's advantages and returns are its piece of the
    unsplit trajectory's, for token-level estimators (GAE's value chain and returns cross the folds) too."""
    masks, scores, mask, _, owner, last, uid = _folded_batch(seed)
    uid[:] = "g"  # one group of 4: GRPO's advantages in a group of 2 are +-0.71 whatever the scores
    _, _, values = _kl_inputs(seed, masks)
    penalty = 0.3 * torch.randn(masks.shape, generator=torch.Generator().manual_seed(seed)) * masks
    rewards = scores_to_token_rewards(scores, masks) - penalty
    kw = {"values": values, "gamma": 0.9, "lam": 0.8} if name == "gae" else {"gamma": 0.95}
    index = np.array(["g"] * 4, dtype=object)
    whole = compute_advantage(name, token_level_rewards=rewards, response_mask=masks, index=index, **kw)
    kw["values"] = _fold(values) if name == "gae" else None
    split = compute_advantage(
        name, token_level_rewards=_fold(rewards), response_mask=mask, index=uid, trajectory=owner, last=last, **kw
    )
    for ours, theirs in zip(split, whole, strict=True):
        assert torch.allclose(ours, _fold(theirs), atol=1e-5)


def _phase_batch(mask, scores, old, ref, values, non_tensors) -> DataProto:
    tensors = {"loss_mask": mask.long(), "token_level_scores": scores_to_token_rewards(scores, mask)}
    tensors.update(old_log_probs=old, ref_log_prob=ref, values=values)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


@pytest.mark.parametrize("recipe", ["search_r1_grpo", "search_r1_drgrpo", "search_r1_ppo", "r1_searcher_rpp"])
def test_kl_in_reward_counts_every_row_of_a_folded_trajectory(recipe):
    """advantage_phase with the in-reward KL penalty: a trajectory split into 2-3 rows (the outcome on every row, as
    reward_phase writes it) gets the advantages of the same trajectory unsplit."""
    over = ["algorithm.use_kl_in_reward=true", "algorithm.kl_coef=0.5", "algorithm.kl_coef_end=0.5"]
    cfg = load_config([f"+recipe={recipe}", *over])
    masks, scores, mask, row_scores, owner, last, uid = _folded_batch(5)
    uid[:] = "g"  # one group of 4 (see above)
    old, ref, values = _kl_inputs(5, masks)
    plain = {"uid": np.array(["g"] * 4, dtype=object)}
    whole, _ = advantage_phase(_phase_batch(masks, scores, old, ref, values, plain), cfg, 0)
    folded = {"uid": uid, "traj_id": np.array(owner, dtype=object), "last_segment": np.array(last, dtype=object)}
    rows = _phase_batch(mask, row_scores, _fold(old), _fold(ref), _fold(values), folded)
    split, _ = advantage_phase(rows, cfg, 0)
    for key in ("advantages", "returns"):
        assert torch.allclose(split.batch[key], _fold(whole.batch[key]), atol=1e-5), key
    assert torch.equal(split.batch["token_level_scores"], rows.batch["token_level_scores"])  # the phase's inputs stay


def test_the_kl_of_an_earlier_row_changes_the_group_score():
    """The previous behaviour (a group estimator read the last row only, so only its KL entered the score) fails here:
    a KL penalty on the first of two rows alone must lower that trajectory's advantage."""
    mask = torch.ones(3, 4)
    rewards = scores_to_token_rewards(torch.tensor([0.0, 0.0, 1.0]), mask)  # the outcome on the last rows
    kl = torch.zeros(3, 4)
    kl[1] = 0.25  # trajectory 1's first row: 4 tokens of penalty 0.25 -> its score is 1 - 1 = 0, not 1
    kw = {"response_mask": mask, "index": np.array(["g"] * 3, dtype=object), "trajectory": np.array([0, 1, 1])}
    kw["last"] = np.array([True, False, True])
    adv, _ = compute_advantage("rloo", token_level_rewards=rewards - kl, **kw)
    # scores 0 (trajectory 0) and 0 (trajectory 1): RLOO advantage 0 everywhere; the last row alone would say +1 / -1
    assert torch.allclose(adv, torch.zeros(3, 4), atol=1e-6)
    adv, _ = compute_advantage("rloo", token_level_rewards=rewards, **kw)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, 1.0]).unsqueeze(-1).expand(3, 4))
