"""Trajectories whose searches failed because the retriever was down are dropped from the update: their loss_mask
rows are zero (no loss, no advantage) and they leave their GRPO group, so the group's baseline is what it would be
without them.

Run: .venv/bin/python -m pytest -q tests/trainer/test_trainer_drops.py
"""

from __future__ import annotations

import numpy as np
import torch
from verl import DataProto

from rsearch_verl import batch as batch_keys
from rsearch_verl.algos.advantages import compute_advantage
from rsearch_verl.config import RSearchConfig
from rsearch_verl.trainer import phases


def _batch(failed: list[bool], uids: list[str]) -> DataProto:
    b, r = len(failed), 4
    mask = torch.tensor([[1, 1, 0, 1]] * b)
    tensors = {"response_mask": mask, "attention_mask": torch.ones(b, 2 + r, dtype=torch.long)}
    tensors["rollout_versions"] = torch.zeros(b, r, dtype=torch.long)  # all from the weights step 1 trains
    non_tensors = {"search_failed": np.array(failed, dtype=object), "uid": np.array(uids, dtype=object)}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def _advantages(batch: DataProto, scores: list[float]) -> torch.Tensor:
    rewards = torch.zeros(batch.batch["loss_mask"].shape)
    rewards[:, -1] = torch.tensor(scores)
    adv, _ = compute_advantage(
        "grpo", token_level_rewards=rewards, response_mask=batch.batch["loss_mask"], index=batch.non_tensor_batch["uid"]
    )
    return adv


def test_failed_trajectories_get_no_loss_and_leave_their_group():
    cfg = RSearchConfig()
    batch = _batch([False, True, False, False], ["a", "a", "a", "b"])
    uids = batch.non_tensor_batch["uid"]
    failed, metrics = phases.failed_search_rows(batch, cfg)
    dropped, new_uids = phases.drop_rows(uids, failed)
    assert dropped.tolist() == [False, True, False, False]
    assert metrics == {"rollout/search_failed": 1.0, "rollout/dropped_trajectories": 1.0}
    assert list(new_uids) == ["a", "a#dropped1", "a", "b"] and list(uids) == ["a", "a", "a", "b"]  # a copy
    # the phase writes both, the uids and the loss_mask, and returns the metrics
    batch, phase_metrics = phases.loss_mask_phase(batch, cfg, step=1)
    assert list(batch.non_tensor_batch["uid"]) == list(new_uids) and phase_metrics.items() >= metrics.items()
    assert batch.batch["loss_mask"][1].sum() == 0
    assert torch.equal(batch.batch["loss_mask"][[0, 2, 3]], batch.batch["response_mask"][[0, 2, 3]])
    adv = _advantages(batch, [1.0, 0.0, 0.0, 1.0])
    assert adv[1].abs().sum() == 0
    alone = _batch([False, False], ["a", "a"])  # group "a" without the dropped trajectory
    alone.batch["loss_mask"] = batch_keys.loss_mask(alone.batch, True)
    assert torch.allclose(adv[[0, 2]], _advantages(alone, [1.0, 0.0]))


def test_keep_failed_when_drop_is_off_and_no_change_without_failures():
    cfg = RSearchConfig()
    cfg.retriever.breaker.drop_failed = False
    batch = _batch([True, False], ["a", "a"])
    failed, metrics = phases.failed_search_rows(batch, cfg)
    dropped, uids = phases.drop_rows(batch.non_tensor_batch["uid"], failed)
    assert metrics == {"rollout/search_failed": 1.0, "rollout/dropped_trajectories": 0.0}
    assert list(uids) == ["a", "a"]
    mask = batch_keys.loss_mask(batch.batch, True, dropped)
    assert mask is batch.batch["response_mask"]  # nothing dropped: the very same mask as without the feature
