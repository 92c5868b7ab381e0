"""Advantage estimators: equal to verl's core_algos on random masked batches, zero and inert at mask-0 positions,
GAE over observation spans equal to GAE on the compacted sequence. Run: pytest -q tests/algos"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos

from rsearch_verl.algos.advantages import ADVANTAGE_ESTIMATORS, compute_advantage, scores_to_token_rewards

NAMES = sorted(ADVANTAGE_ESTIMATORS)


def make_batch(seed: int, batch: int = 8, length: int = 12, group: int = 4):
    """Rows: policy span, an interior observation span (mask 0), more policy tokens, right padding."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, length)
    for row in range(batch):
        end = int(torch.randint(4, length + 1, (1,), generator=gen))
        mask[row, :end] = 1
        start = int(torch.randint(1, max(2, end - 2), (1,), generator=gen))
        span = int(torch.randint(0, 3, (1,), generator=gen))
        mask[row, start : min(start + span, end - 1)] = 0
    scores = torch.randn(batch, generator=gen)
    rewards = scores_to_token_rewards(scores, mask)
    values = torch.randn(batch, length, generator=gen)
    index = np.array([f"uid{row // group}" for row in range(batch)], dtype=object)
    return rewards, mask, values, index


def run(name, rewards, mask, values, index, **kw):
    return compute_advantage(name, token_level_rewards=rewards, response_mask=mask, index=index, values=values, **kw)


def verl_reference(name, rewards, mask, values, index, gamma, lam):
    if name == "gae":
        return core_algos.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    if name in ("grpo", "drgrpo", "dr_grpo"):
        return core_algos.compute_grpo_outcome_advantage(
            rewards.clone(), mask, index, norm_adv_by_std_in_grpo=name == "grpo"
        )
    if name == "rloo":
        return core_algos.compute_rloo_outcome_advantage(rewards.clone(), mask, index)
    if name == "reinforce_plus_plus":
        return core_algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=AlgoConfig(gamma=gamma))
    return core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards.clone(), mask, index)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_verl_on_random_masked_batches(name, seed):
    rewards, mask, values, index = make_batch(seed)
    gamma, lam = (0.95, 0.9) if seed else (1.0, 1.0)
    adv, ret = run(name, rewards, mask, values, index, gamma=gamma, lam=lam)
    ref_adv, ref_ret = verl_reference(name, rewards, mask, values, index, gamma, lam)
    torch.testing.assert_close(adv, ref_adv * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, ref_ret * mask, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_masked_positions_are_zero_and_inert(name):
    rewards, mask, values, index = make_batch(3)
    adv, ret = run(name, rewards, mask, values, index, gamma=0.9, lam=0.95)
    off = mask == 0
    assert torch.all(adv[off] == 0) and torch.all(ret[off] == 0)
    assert torch.all(torch.isfinite(adv)) and torch.all(torch.isfinite(ret))
    # garbage (even NaN) in values / rewards at observation positions must change nothing
    noisy_values = torch.where(off, torch.full_like(values, float("nan")), values)
    noisy_rewards = torch.where(off, torch.randn_like(rewards) * 100, rewards)
    adv2, ret2 = run(name, noisy_rewards, mask, noisy_values, index, gamma=0.9, lam=0.95)
    torch.testing.assert_close(adv2, adv)
    torch.testing.assert_close(ret2, ret)


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus"])
def test_skipping_masked_spans_equals_compacted_sequence(name):
    """The value/return chain jumps over observations: same result as cutting them out of the sequence."""
    rewards, mask, values, index = make_batch(4)
    # dense per-token rewards, so the discounting across the gap is actually exercised
    rewards = torch.randn(rewards.shape, generator=torch.Generator().manual_seed(9)) * mask
    compact_r, compact_v, compact_m = (torch.zeros_like(rewards) for _ in range(3))
    for row in range(mask.shape[0]):
        keep = mask[row].bool()
        n = int(keep.sum())
        compact_r[row, :n], compact_v[row, :n], compact_m[row, :n] = rewards[row, keep], values[row, keep], 1
    adv, ret = run(name, rewards, mask, values, index, gamma=0.9, lam=0.8)
    c_adv, c_ret = run(name, compact_r, compact_m, compact_v, index, gamma=0.9, lam=0.8)
    for row in range(mask.shape[0]):
        keep, n = mask[row].bool(), int(mask[row].sum())
        torch.testing.assert_close(adv[row, keep], c_adv[row, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret[row, keep], c_ret[row, :n], atol=1e-5, rtol=1e-5)


def test_gae_returns_by_hand():
    """One row, policy tokens at 0,1 and 4 (2,3 = observation): returns follow the policy-token chain."""
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 0]])
    rewards = torch.tensor([[0.0, 0, 0, 0, 1.0, 0]])
    values = torch.tensor([[0.5, 0.2, 9.0, 9.0, 0.3, 9.0]])
    gamma, lam = 0.9, 0.5
    _, ret = run("gae", rewards, mask, values, np.array(["a"]), gamma=gamma, lam=lam)
    d4 = 1.0 - 0.3
    d1 = 0.0 + gamma * 0.3 - 0.2
    d0 = 0.0 + gamma * 0.2 - 0.5
    a4, a1 = d4, d1 + gamma * lam * d4
    a0 = d0 + gamma * lam * a1
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.2, 0, 0, a4 + 0.3, 0]]))


def test_grpo_and_drgrpo_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 3.0])
    mask = torch.ones(4, 3)
    rewards = scores_to_token_rewards(scores, mask)
    index = np.array(["a", "a", "b", "b"], dtype=object)
    adv, _ = run("grpo", rewards, mask, None, index)
    dr, _ = run("drgrpo", rewards, mask, None, index)
    std_a, std_b = torch.tensor([1.0, 0.0]).std(), torch.tensor([0.0, 3.0]).std()
    expected = torch.tensor([0.5 / std_a, -0.5 / std_a, -1.5 / std_b, 1.5 / std_b])
    torch.testing.assert_close(adv[:, 0], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, -1.5, 1.5])[:, None].expand(4, 3))
    rloo, _ = run("rloo", rewards, mask, None, index)
    torch.testing.assert_close(rloo[:, 0], torch.tensor([1.0, -1.0, -3.0, 3.0]))


def test_scores_to_token_rewards():
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    out = scores_to_token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    expected = torch.tensor([[0, 0, 0, 2.0, 0], [-1.0, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError):
        scores_to_token_rewards(torch.zeros(2), mask)


@pytest.mark.parametrize("name", NAMES)
def test_degenerate_batches_give_finite_zeros(name):
    mask = torch.tensor([[0.0, 1, 0], [0, 0, 0]])
    rewards = scores_to_token_rewards(torch.tensor([1.0, 2.0]), mask)
    adv, ret = run(name, rewards, mask, torch.ones(2, 3), np.array(["a", "a"]), gamma=0.9, lam=0.9)
    assert torch.all(torch.isfinite(adv)) and torch.all(torch.isfinite(ret))
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


def test_bad_input_errors():
    rewards, mask, values, index = make_batch(0)
    with pytest.raises(ValueError, match="known"):
        run("ppo2", rewards, mask, values, index)
    with pytest.raises(ValueError, match="values"):
        run("gae", rewards, mask, None, index)
    with pytest.raises(ValueError, match="values"):  # also on a batch too small to whiten
        run("gae", rewards, torch.zeros_like(mask), None, index)
    with pytest.raises(ValueError, match="index"):
        run("grpo", rewards, mask, None, index[:3])


def test_grpo_without_std_is_drgrpo():
    rewards, mask, values, index = make_batch(6)
    plain, _ = run("grpo", rewards, mask, values, index, norm_adv_by_std_in_grpo=False)
    for name in ("drgrpo", "dr_grpo"):
        torch.testing.assert_close(run(name, rewards, mask, values, index)[0], plain)
