"""KL estimators against closed forms and verl, the in-reward KL penalty and the β schedule.
Run: pytest -q tests/algos"""

from __future__ import annotations

import pytest
import torch
from verl.trainer.ppo import core_algos

from rsearch_verl.algos.kl import KL_KINDS, apply_kl_penalty, kl_coef_at, kl_estimate


def test_estimators_closed_forms():
    lp = torch.tensor([[-1.0, -2.0, -0.5, -2.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -0.2]])
    r = lp - ref
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), r)
    torch.testing.assert_close(kl_estimate(lp, ref, "abs"), r.abs())
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), 0.5 * r**2)
    torch.testing.assert_close(kl_estimate(lp, ref, "mse"), 0.5 * r**2)
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"), torch.exp(-r) + r - 1)
    torch.testing.assert_close(kl_estimate(lp, ref, "low_var_kl"), torch.exp(-r) + r - 1)


def test_k3_is_clamped_like_verl():
    lp = torch.tensor([0.0, 0.0, -30.0, -8.0])
    ref = torch.tensor([-30.0, 30.0, 0.0, 0.0])
    ours = kl_estimate(lp, ref, "k3")
    torch.testing.assert_close(ours, core_algos.kl_penalty(lp, ref, "low_var_kl"))
    assert ours.max().item() == pytest.approx(10.0) and torch.all(torch.isfinite(ours))


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_unbiased_estimators_average_to_the_true_kl(kind):
    """E_{x~p}[k(x)] = KL(p || q) exactly for k1 and k3 (weights = p, not samples; ratios inside the clamp)."""
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(0.3 * torch.randn(50, generator=gen), -1)
    logq = torch.log_softmax(0.3 * torch.randn(50, generator=gen), -1)
    true_kl = (logp.exp() * (logp - logq)).sum()
    est = (logp.exp() * kl_estimate(logp, logq, kind)).sum()
    assert est.item() == pytest.approx(true_kl.item(), rel=1e-4)


def test_apply_kl_penalty_masks_and_reports():
    scores = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -1.0, -1.0], [-1.0, -1.0, -5.0, -5.0]])
    ref = torch.tensor([[-1.5, -1.0, float("nan"), -0.5], [-2.0, -1.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]])
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, beta=0.1, kind="k1")
    kl = torch.tensor([[0.5, -1.0, 0.0, -0.5], [1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, scores - 0.1 * kl)
    # verl's definition: the mean over trajectories of each one's mean over its policy tokens
    assert metrics == {"actor/reward_kl": pytest.approx(((0.5 - 1.0 - 0.5) / 3 + (1.0 + 0.0) / 2) / 2)}
    empty, m = apply_kl_penalty(scores, old, ref, torch.zeros_like(mask), beta=0.1, kind="k3")
    torch.testing.assert_close(empty, scores)
    assert m["actor/reward_kl"] == 0.0


def test_kl_coef_schedules():
    assert kl_coef_at(7, 10, start=0.01, end=0.0, schedule="constant") == 0.01
    assert kl_coef_at(0, 10, start=0.01, end=0.0, schedule="linear") == pytest.approx(0.01)
    assert kl_coef_at(5, 10, start=0.01, end=0.0, schedule="linear") == pytest.approx(0.005)
    assert kl_coef_at(10, 10, start=0.01, end=0.0, schedule="linear") == pytest.approx(0.0)
    assert kl_coef_at(25, 10, start=0.001, end=0.003, schedule="linear") == pytest.approx(0.003)
    with pytest.raises(ValueError, match="total_steps"):
        kl_coef_at(1, 0, start=0.1, end=0.0, schedule="linear")
    with pytest.raises(ValueError, match="constant"):
        kl_coef_at(1, 10, start=0.1, end=0.0, schedule="cosine")


def test_unknown_estimator_lists_the_known_ones():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(x, x, "k4")
    with pytest.raises(ValueError, match="differ"):
        kl_estimate(x, torch.zeros(3), "k1")
    assert {"k1", "k2", "k3", "abs", "mse", "low_var_kl"} <= set(KL_KINDS)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_apply_kl_penalty_matches_verl_on_policy_tokens(kind):
    gen = torch.Generator().manual_seed(1)
    old, ref = (0.7 * torch.randn(4, 9, generator=gen) for _ in range(2))
    scores = torch.zeros(4, 9)
    scores[:, -1] = torch.randn(4, generator=gen)
    mask = (torch.rand(4, 9, generator=gen) > 0.3).float()
    rewards, _ = apply_kl_penalty(scores, old, ref, mask, beta=0.05, kind=kind)
    # verl's ray_trainer.apply_kl_penalty: scores - beta * kl_penalty(...) * response_mask
    expected = scores - 0.05 * core_algos.kl_penalty(old, ref, KL_KINDS[kind]) * mask
    torch.testing.assert_close(rewards, expected)
    if kind == "k1":
        torch.testing.assert_close(rewards, core_algos.compute_rewards(scores, old * mask, ref * mask, 0.05))


def test_reward_kl_metric_equals_verls():
    """`actor/reward_kl` is exactly verl's `actor/reward_kl_penalty` (ray_trainer.apply_kl_penalty) on one batch."""
    from tensordict import TensorDict
    from verl import DataProto
    from verl.trainer.ppo.core_algos import FixedKLController
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty as verl_apply_kl_penalty

    gen = torch.Generator().manual_seed(3)
    old, ref = -torch.rand(6, 9, generator=gen) * 3, -torch.rand(6, 9, generator=gen) * 3
    lengths = torch.tensor([9, 1, 4, 0, 7, 2])
    mask = (torch.arange(9)[None, :] < lengths[:, None]).long()
    scores = torch.zeros(6, 9)
    batch = TensorDict(
        {"response_mask": mask, "token_level_scores": scores, "old_log_probs": old, "ref_log_prob": ref},
        batch_size=[6],
    )
    _, verl_metrics = verl_apply_kl_penalty(DataProto(batch=batch), FixedKLController(0.1), kl_penalty="kl")
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, beta=0.1, kind="k1")
    assert metrics["actor/reward_kl"] == pytest.approx(verl_metrics["actor/reward_kl_penalty"], abs=1e-7)
    torch.testing.assert_close(rewards, scores - 0.1 * (old - ref) * mask)
