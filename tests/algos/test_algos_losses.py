"""Losses: agg modes by hand, PPO policy loss and value loss against verl's core_algos, dual-clip, entropy,
and masked positions contributing neither loss nor gradient. Run: pytest -q tests/algos"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from verl.trainer.ppo import core_algos

from rsearch_verl.algos import losses


def masked_inputs(seed: int, batch: int = 6, length: int = 10):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, length, generator=gen) > 0.35).float()
    mask[0] = 0  # a row that holds only observations/padding
    mask[1, 2:5] = 0  # an interior observation span
    mask[2, 0] = 1
    new, old, adv = (torch.randn(batch, length, generator=gen) for _ in range(3))
    return new * 0.5, old * 0.5, adv, mask


def test_agg_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    assert losses.agg_loss(loss, mask, "token-mean").item() == pytest.approx((1 + 2 + 6) / 3)
    assert losses.agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 6) / 2)
    assert losses.agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 6) / 2)
    assert losses.agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((3 + 6) / 2 / 3)  # width 3
    scaled = losses.agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=512)
    assert scaled.item() == pytest.approx(4.5 / 512)
    for mode in losses.LOSS_AGG_MODES:
        empty = losses.agg_loss(loss.requires_grad_(), torch.zeros_like(mask), mode)
        assert empty.item() == 0.0 and empty.requires_grad
    with pytest.raises(ValueError, match="known"):
        losses.agg_loss(loss, mask, "token-sum")


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_policy_loss_matches_verl(mode, seed):
    new, old, adv, mask = masked_inputs(seed)
    new = new * 3  # large ratios so both clip sides and the dual clip are active
    loss, metrics = losses.policy_loss(
        old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # verl marks the functional form deprecated; the maths is what we compare
        ref = core_algos.compute_policy_loss(
            old, new, adv, mask, cliprange_low=0.2, cliprange_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode
        )
    ref_loss, ref_clipfrac, ref_kl, ref_lower = ref
    torch.testing.assert_close(loss, ref_loss)
    assert metrics["actor/pg_loss"] == pytest.approx(ref_loss.item(), abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(ref_clipfrac.item(), abs=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(ref_lower.item(), abs=1e-6)
    assert metrics["actor/ppo_kl"] == pytest.approx(ref_kl.item(), abs=1e-6)
    assert metrics["actor/pg_clipfrac"] > 0 and metrics["actor/pg_clipfrac_lower"] > 0


def test_dual_clip_by_hand():
    mask = torch.ones(1, 3)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    new = torch.tensor([[2.0, 0.0, 2.0]])  # ratios e², 1, e²
    old = torch.zeros(1, 3)
    loss, metrics = losses.policy_loss(old, new, adv, mask, clip_ratio_c=3.0, loss_agg_mode="seq-mean-token-sum")
    # token 0: max(e², 1.2) = e² capped by the dual clip at 3; token 1: 1; token 2: max(-e², -1.2) = -1.2
    assert loss.item() == pytest.approx(3.0 + 1.0 - 1.2, abs=1e-5)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 3)
    for disabled in (None, 1.0):
        off, m_off = losses.policy_loss(old, new, adv, mask, clip_ratio_c=disabled, loss_agg_mode="seq-mean-token-sum")
        assert off.item() == pytest.approx(math.exp(2.0) + 1.0 - 1.2, abs=1e-5)
        assert m_off["actor/pg_clipfrac_lower"] == 0.0


def test_policy_loss_ignores_masked_positions_and_their_gradients():
    new, old, adv, mask = masked_inputs(2)
    off = mask == 0
    for mode in losses.LOSS_AGG_MODES:
        a = new.clone().requires_grad_()
        loss, _ = losses.policy_loss(old, a, adv, mask, loss_agg_mode=mode)
        loss.backward()
        b = torch.where(off, torch.randn_like(new) * 50, new).requires_grad_()
        garbage_old = torch.where(off, torch.full_like(old, float("nan")), old)
        loss2, _ = losses.policy_loss(garbage_old, b, adv * (1 + 100 * off), mask, loss_agg_mode=mode)
        loss2.backward()
        torch.testing.assert_close(loss2, loss)
        torch.testing.assert_close(b.grad, a.grad)
        assert torch.all(a.grad[off] == 0) and torch.any(a.grad[~off] != 0)


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_value_loss_matches_verl_and_ignores_masked_positions(mode):
    vpred, old_v, returns, mask = masked_inputs(5)
    vpred = vpred * 4
    a = vpred.clone().requires_grad_()
    loss, metrics = losses.value_loss(a, old_v, returns, mask, cliprange_value=0.5, loss_agg_mode=mode)
    ref_loss, ref_clipfrac = core_algos.compute_value_loss(vpred, returns, old_v, mask, 0.5, loss_agg_mode=mode)
    torch.testing.assert_close(loss, ref_loss)
    assert metrics["critic/vf_loss"] == pytest.approx(ref_loss.item(), abs=1e-6)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(ref_clipfrac.item(), abs=1e-6)
    assert metrics["critic/vpred_mean"] == pytest.approx((vpred * mask).sum().item() / mask.sum().item(), abs=1e-5)
    loss.backward()
    off = mask == 0
    b = torch.where(off, torch.randn_like(vpred) * 1e3, vpred).requires_grad_()
    loss2, _ = losses.value_loss(
        b, torch.where(off, float("inf"), old_v), returns, mask, cliprange_value=0.5, loss_agg_mode=mode
    )
    loss2.backward()
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(b.grad, a.grad)
    assert torch.all(a.grad[off] == 0)


def test_entropy_closed_forms():
    uniform = torch.zeros(2, 3, 7)
    torch.testing.assert_close(losses.entropy_from_logits(uniform), torch.full((2, 3), math.log(7)))
    peaked = torch.tensor([[[100.0, 0.0, 0.0]]])
    assert losses.entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)
    logits = torch.randn(4, 5)
    p = logits.softmax(-1)
    torch.testing.assert_close(losses.entropy_from_logits(logits), -(p * p.log()).sum(-1))


def test_kl_loss_masked_and_metric():
    new, ref, _, mask = masked_inputs(7)
    a = new.clone().requires_grad_()
    loss, metrics = losses.kl_loss(a, ref, mask, "low_var_kl", "token-mean")
    kl = torch.exp(ref - new) - (ref - new) - 1
    assert loss.item() == pytest.approx(((kl * mask).sum() / mask.sum()).item(), abs=1e-5)
    assert metrics["actor/kl_loss"] == pytest.approx(loss.item())
    loss.backward()
    off = mask == 0
    assert torch.all(a.grad[off] == 0)
    loss2, _ = losses.kl_loss(new, torch.where(off, float("nan"), ref), mask, kind="k3", loss_agg_mode="token-mean")
    torch.testing.assert_close(loss2, loss.detach())


def test_shape_mismatch_is_a_clear_error():
    new, old, adv, mask = masked_inputs(0)
    with pytest.raises(ValueError, match="shape"):
        losses.policy_loss(old[:, :3], new, adv, mask)
    with pytest.raises(ValueError, match="known"):
        losses.value_loss(new, old, adv, mask, loss_agg_mode="seq-sum")


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_micro_batches_with_global_denominator_sum_to_the_full_batch(mode):
    """What a data-parallel update relies on: per-piece losses with the global count add up to the batch loss."""
    new, old, adv, mask = masked_inputs(11, batch=8)
    full_lp = new.clone().requires_grad_()
    full, _ = losses.policy_loss(old, full_lp, adv, mask, loss_agg_mode=mode)
    full.backward()
    denominator = losses.agg_denominator(mask, mode)
    pieces_lp = new.clone().requires_grad_()
    total = sum(
        losses.policy_loss(old[s], pieces_lp[s], adv[s], mask[s], loss_agg_mode=mode, denominator=denominator)[0]
        for s in (slice(0, 3), slice(3, 8))
    )
    total.backward()
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(pieces_lp.grad, full_lp.grad)
    assert losses.agg_denominator(mask[:1], mode) == 0.0  # row 0 holds no policy token
    with pytest.raises(ValueError, match="denominator"):
        losses.agg_loss(new, mask, mode, denominator=0.0)


def test_masked_entropy_has_no_gradient_at_observations():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 11, generator=gen)
    mask = torch.tensor([[1.0, 1, 0, 0, 1], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]])
    a = logits.clone().requires_grad_()
    ent = losses.agg_loss(losses.entropy_from_logits(a), mask, "token-mean")
    ent.backward()
    off = mask == 0
    assert torch.all(a.grad[off] == 0) and torch.any(a.grad[~off] != 0)
    garbage = torch.where(off[..., None], torch.randn(logits.shape, generator=gen) * 1e3, logits)
    torch.testing.assert_close(losses.agg_loss(losses.entropy_from_logits(garbage), mask, "token-mean"), ent.detach())
    ref = core_algos.compute_entropy_loss(logits, mask, loss_agg_mode="token-mean")
    torch.testing.assert_close(ent.detach(), ref)


@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "low_var_kl"])
@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_kl_loss_matches_verl(kind, mode):
    new, ref, _, mask = masked_inputs(13)
    loss, _ = losses.kl_loss(new, ref, mask, kind, mode)
    expected = core_algos.agg_loss(core_algos.kl_penalty(new, ref, kind), mask, mode)
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drgrpo_aggregation_matches_verls_agg_loss(seed):
    """Dr.GRPO's seq-mean-token-sum-norm with a constant scale: our losses.agg_loss (whole batch, and summed over a
    micro-batch split with the global denominator) equals verl's `losses.agg_loss` in that mode, value and gradient."""
    new, _, _, mask = masked_inputs(seed, batch=8, length=12)
    mine = new.clone().requires_grad_()
    theirs = new.clone().requires_grad_()
    ours = losses.agg_loss(mine, mask, "seq-mean-token-sum-norm", loss_scale_factor=512)
    ref = core_algos.agg_loss(theirs, mask, "seq-mean-token-sum-norm", loss_scale_factor=512)
    assert ours.item() == pytest.approx(ref.item(), abs=1e-7)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(mine.grad, theirs.grad)
    # micro-batches, each padded only to its own longest row: the constant scale makes their sum the batch loss
    denom = losses.agg_denominator(mask, "seq-mean-token-sum-norm")
    total = 0.0
    for rows in (slice(0, 3), slice(3, 6), slice(6, 8)):
        width = int(mask[rows].nonzero()[:, 1].max()) + 1 if mask[rows].any() else 1
        piece = losses.agg_loss(
            new[rows, :width], mask[rows, :width], "seq-mean-token-sum-norm", denominator=denom, loss_scale_factor=512
        )
        total += piece.item()
    assert total == pytest.approx(ref.item(), abs=1e-6)


def test_drgrpo_recipe_selects_its_aggregation():
    from rsearch_verl.config import load_config

    cfg = load_config(["+recipe=search_r1_drgrpo"])
    assert cfg.algorithm.adv_estimator == "drgrpo" and cfg.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    assert cfg.loss_scale_factor == cfg.rollout.max_response_length
