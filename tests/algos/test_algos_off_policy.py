"""Off-policy correction and the staleness guard of asynchronous training, on hand-made batches.

The importance weights equal pi_prox / pi_behav (clipped for TIS, left out above the cap for decoupled PPO) and are 0
outside the loss mask; they scale each token's PPO loss; the driver's staleness guard counts versions per row.
Run: .venv/bin/python -m pytest -q tests/algos/test_algos_off_policy.py
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from verl import DataProto

from rsearch_verl.algos.losses import policy_loss
from rsearch_verl.algos.off_policy import importance_weights
from rsearch_verl.config import ConfigError, RSearchConfig, from_omegaconf
from rsearch_verl.trainer import phases

# pi_behav (rollout) and pi_prox (actor before the update) per token; the last column is an observation (mask 0)
BEHAV = torch.tensor([[0.5, 0.2, 0.9, 0.3], [0.4, 0.1, 0.8, 0.6]])
PROX = torch.tensor([[0.5, 0.5, 0.45, 0.9], [0.6, 0.4, 0.8, 0.1]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])


def test_tis_weights_are_the_clipped_ratio_and_zero_off_the_mask():
    w, m = importance_weights(PROX.log(), BEHAV.log(), MASK, "tis", is_cap=2.0)
    want = torch.tensor([[1.0, 2.0, 0.5, 0.0], [1.5, 2.0, 1.0, 0.0]])  # 0.5/0.2 = 2.5 and 0.4/0.1 = 4 -> cap 2
    assert torch.allclose(w, want, atol=1e-6)
    assert m["off_policy/is_weight_max"] == pytest.approx(2.0)
    assert m["off_policy/raw_weight_max"] == pytest.approx(4.0, rel=1e-5)
    assert m["off_policy/capped_frac"] == pytest.approx(2 / 6)


def test_decoupled_weights_leave_tokens_above_the_cap_out():
    w, m = importance_weights(PROX.log(), BEHAV.log(), MASK, "decoupled", is_cap=2.0)
    want = torch.tensor([[1.0, 0.0, 0.5, 0.0], [1.5, 0.0, 1.0, 0.0]])
    assert torch.allclose(w, want, atol=1e-6)
    assert m["off_policy/is_weight_mean"] == pytest.approx(float(want[MASK.bool()].mean()), rel=1e-6)


def test_weights_scale_each_tokens_policy_loss():
    # ratio 1 (log_prob == old_log_prob): each token's clipped loss is -A, so the weighted token-mean is by hand
    adv = torch.tensor([[1.0, -2.0, 0.5, 9.0], [3.0, 1.0, -1.0, 9.0]])
    w, _ = importance_weights(PROX.log(), BEHAV.log(), MASK, "tis", is_cap=2.0)
    loss, _ = policy_loss(PROX.log(), PROX.log(), adv, MASK, is_weights=w)
    by_hand = -(w * adv * MASK).sum() / MASK.sum()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)
    plain, _ = policy_loss(PROX.log(), PROX.log(), adv, MASK)
    assert plain.item() == pytest.approx(-(adv * MASK).sum().item() / MASK.sum().item(), rel=1e-6)


def test_bad_mode_and_empty_mask():
    with pytest.raises(ValueError, match="mode"):
        importance_weights(PROX.log(), BEHAV.log(), MASK, "none")
    w, m = importance_weights(PROX.log(), BEHAV.log(), torch.zeros_like(MASK), "tis")
    assert not w.any() and m == {}


def _versions_batch(versions: list[list[int]]) -> DataProto:
    v = torch.tensor(versions)
    mask = (v >= 0).long()
    nt = {"uid": np.array([f"u{i}" for i in range(len(versions))], dtype=object)}
    return DataProto.from_dict(tensors={"rollout_versions": v, "response_mask": mask}, non_tensors=nt)


def test_stale_rows_measure_staleness_per_row_and_drop_beyond_the_bound():
    # step 5 trains the weights of step 4: rows from versions 4, 3, {3,4} (a partial rollout), 2 and none at all
    batch = _versions_batch([[4, 4, -1], [3, -1, 3], [3, 4, 4], [2, 2, -1], [-1, -1, -1]])
    stale, metrics = phases.stale_rows(batch, step=5, max_staleness=1)
    assert stale.tolist() == [False, False, False, True, False]
    assert metrics["async/staleness_max"] == 2.0
    assert metrics["async/staleness_mean"] == pytest.approx((0 + 1 + 1 + 2 + 0) / 5)
    assert metrics["async/staleness_0_frac"] == pytest.approx(2 / 5)
    assert metrics["async/staleness_1_frac"] == pytest.approx(2 / 5)
    assert metrics["async/partial_rows_frac"] == pytest.approx(1 / 5)
    assert metrics["async/dropped_stale"] == 1.0
    dropped, uids = phases.drop_rows(batch.non_tensor_batch["uid"], stale, None)
    assert list(uids) == ["u0", "u1", "u2", "u3#dropped3", "u4"]
    assert dropped.tolist() == stale.tolist()


def test_sampled_entropy_scores_each_token_by_the_policy_that_sampled_it():
    """Step 5 trains the weights of step 4: its tokens are scored by the actor, older ones by the rollout engine (the
    actor's log-prob of a stale token is a cross-entropy); observations (-1) count in neither."""
    batch = _versions_batch([[4, 3, -1], [3, 3, 4]])
    batch.batch["old_log_probs"] = torch.tensor([[-0.1, -2.0, -9.0], [-3.0, -3.0, -0.3]])  # the actor (version 4)
    batch.batch["rollout_log_probs"] = torch.tensor([[-0.2, -0.4, 0.0], [-0.5, -0.6, -0.7]])  # the sampling engine
    assert phases.sampled_entropy(batch, 4)["rollout/entropy_mc"] == pytest.approx((0.1 + 0.4 + 0.5 + 0.6 + 0.3) / 5)
    # synchronous: every token is the current version's, so all are the actor's
    sync = _versions_batch([[4, 4, -1]])
    sync.batch["old_log_probs"], sync.batch["rollout_log_probs"] = torch.tensor([[-0.1, -0.3, -9.0]]), torch.zeros(1, 3)
    assert phases.sampled_entropy(sync, 4)["rollout/entropy_mc"] == pytest.approx(0.2)


def test_async_config_is_validated():
    def cfg(**trainer):
        return from_omegaconf({"rollout": {"n": 2}, "trainer": trainer, "algorithm": {"off_policy": off_policy}})

    off_policy = {}
    with pytest.raises(ConfigError, match="placement=split"):
        cfg(max_staleness=1)
    assert cfg(max_staleness=1, placement="split").off_policy_mode == "decoupled"  # auto: on when samples can be stale
    assert cfg(max_staleness=0, placement="split").off_policy_mode == "none"
    # synchronous in low precision: the engine's decode and the actor's forward round differently -> TIS by default
    bf16 = from_omegaconf({"rollout": {"n": 2}, "model": {"dtype": "bfloat16"}, "algorithm": {"off_policy": {}}})
    assert bf16.off_policy_mode == "tis" and RSearchConfig().off_policy_mode == "none"
    with pytest.raises(ConfigError, match="mid_trajectory_update"):
        cfg(max_staleness=1, placement="split", mid_trajectory_update="sometimes")
    off_policy = {"mode": "bogus"}
    with pytest.raises(ConfigError, match="off_policy.mode"):
        cfg()
    off_policy = {"mode": "tis", "is_cap": 1.0}
    with pytest.raises(ConfigError, match="is_cap"):
        cfg()
    assert math.isclose(RSearchConfig().algorithm.off_policy.is_cap, 2.0)
