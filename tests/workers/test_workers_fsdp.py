"""FSDP actor workers on a real local Ray cluster over gloo: data-parallel equivalence and observation masking.

- 2 ranks and 1 rank give the same loss and the same parameters after an update on the same batch;
- what the loss reads at observation positions (mask 0) — token-level advantages, old / reference log-probs, and
  the ids of a trailing observation block — changes no parameter update. (Tokens *after* an observation do
  condition on it through attention, as they must: that is context, not a trained target.)
- the no-masking ablation (algorithm.mask_observations=false) reaches actor, critic, KL and advantages alike:
  the driver's one `loss_mask` then covers observation tokens, and each of them uses those positions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pool_helpers import one_pool  # tests/workers/pool_helpers.py
from verl import DataProto

from rsearch_verl import signals as sig
from rsearch_verl.config import load_config
from rsearch_verl.testing.batches import sequence_tensors
from rsearch_verl.workers.metrics import reduce_metrics
from rsearch_verl.workers.placement import start_group

ray = pytest.importorskip("ray")

P, R, B = 6, 10, 4


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False)
    yield
    ray.shutdown()


def make_cfg(n_workers: int, **extra):
    overrides = [
        "model=tiny",
        "model.sft_checkpoint=null",  # a random policy: no warm start needed here
        "trainer=cpu",
        f"trainer.n_workers={n_workers}",
        "data.train_batch_size=4",
        "rollout.n=1",
        "algorithm.adv_estimator=reinforce_plus_plus",
        "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=1" if n_workers == 2 else "actor.micro_batch_size=2",
        "actor.optim.lr=1e-2",
        "actor.use_kl_loss=true",
        "actor.kl_loss_type=low_var_kl",
        *[f"{k}={v}" for k, v in extra.items()],
    ]
    return load_config(overrides)


def make_batch(vocab: int, seed: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (B, P), generator=g)
    responses = torch.randint(3, vocab, (B, R), generator=g)
    response_mask = torch.ones(B, R, dtype=torch.long)
    response_mask[:, 3:6] = 0  # an observation in the middle of every response
    response_mask[0, 8:] = 0  # and a trailing one in row 0
    attention = torch.ones(B, P + R, dtype=torch.long)
    attention[1, :2] = 0  # left padding
    attention[2, -2:] = 0  # right padding
    response_mask = response_mask * attention[:, P:]
    tensors = {
        **sequence_tensors(prompts, responses, attention, response_mask),  # loss_mask: observations masked
        "advantages": torch.randn(B, R, generator=g),
        "old_log_probs": -torch.rand(B, R, generator=g) * 5,
        "ref_log_prob": -torch.rand(B, R, generator=g) * 5,
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"kl_coef": 0.1})


def run_update(cfg, batch: DataProto, with_old_from_model: bool = True):
    from rsearch_verl.workers.actor import ActorWorker

    name = f"t{cfg.trainer.n_workers}"
    group = start_group(one_pool(cfg, name), ActorWorker, cfg, name, with_rollout=False)
    try:
        if with_old_from_model:  # on-policy ratios start at 1, as in training
            batch = batch.union(group.compute_log_prob(batch)) if "old_log_probs" not in batch.batch else batch
        metrics = reduce_metrics(group.update_actor(batch).meta_info)
        state = group.full_state_dict()[0]
    finally:
        for w in group.workers:
            ray.kill(w)
        for pg in group.resource_pool.pgs or []:
            ray.util.remove_placement_group(pg)
    return metrics, state


def vocab_size(cfg) -> int:
    from rsearch_verl.workers.generation import build_policy

    tok, _ = build_policy(cfg)
    return len(tok)


def test_two_ranks_equal_one_rank(ray_cluster):
    cfg1, cfg2 = make_cfg(1), make_cfg(2)
    batch = make_batch(vocab_size(cfg1))
    m1, s1 = run_update(cfg1, batch)
    m2, s2 = run_update(cfg2, batch)
    assert {sig.PG_LOSS, sig.KL_LOSS, sig.ACTOR_GRAD_NORM} <= m1.keys()  # what the health watchdog reads
    assert m1["actor/pg_loss"] == pytest.approx(m2["actor/pg_loss"], rel=1e-4, abs=1e-6)
    assert m1["actor/kl_loss"] == pytest.approx(m2["actor/kl_loss"], rel=1e-4, abs=1e-6)
    init = _initial_state(cfg1)
    changed = max(float((s1[k] - init[k]).abs().max()) for k in s1)
    assert changed > 1e-4, "the update did not move the parameters"
    # An Adam step moves each weight by ~lr = 1e-2; 5e-5 leaves room for summation-order rounding through Adam's
    # normalisation (measured: 1 of 65536 weights of the 3-layer tiny model off by 2.1e-5), none for a sharding bug.
    for k in s1:
        torch.testing.assert_close(s1[k], s2[k], rtol=1e-4, atol=5e-5, msg=lambda m, k=k: f"parameter {k} differs: {m}")


def _initial_state(cfg):
    from rsearch_verl.workers.generation import build_policy

    _, model = build_policy(cfg)
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_observation_positions_change_no_update(ray_cluster):
    cfg = make_cfg(1)
    base = make_batch(vocab_size(cfg))
    other = make_batch(vocab_size(cfg))
    obs = base.batch["response_mask"] == 0
    g = torch.Generator().manual_seed(7)
    t = other.batch
    for key in ("advantages", "old_log_probs", "ref_log_prob"):
        t[key] = torch.where(obs, torch.randn(B, R, generator=g) * 10, t[key])
    # the trailing observation of row 0 (positions 8, 9): nothing after it is trained
    resp = t["responses"].clone()
    resp[0, 8:] = (resp[0, 8:] + 5) % 100 + 3
    t["responses"] = resp
    t["input_ids"] = torch.cat([t["prompts"], resp], dim=1)
    m_a, s_a = run_update(cfg, base)
    m_b, s_b = run_update(cfg, other)
    assert m_a["actor/pg_loss"] == pytest.approx(m_b["actor/pg_loss"], abs=1e-7)
    for k in s_a:
        torch.testing.assert_close(s_a[k], s_b[k], rtol=0, atol=1e-7, msg=f"parameter {k} moved differently")
    # and the check can fail: the same edit on a policy position does change the update
    t["advantages"][1, 0] += 5.0
    m_c, s_c = run_update(cfg, other)
    assert max(float((s_a[k] - s_c[k]).abs().max()) for k in s_a) > 1e-6


def _ablation_batch(cfg) -> DataProto:
    """make_batch with the loss mask the driver writes for algorithm.mask_observations=false."""
    from rsearch_verl.batch import loss_mask

    batch = make_batch(vocab_size(cfg))
    assert not cfg.algorithm.mask_observations
    batch.batch["loss_mask"] = loss_mask(batch.batch, cfg.algorithm.mask_observations)
    assert (batch.batch["loss_mask"] != batch.batch["response_mask"]).any()
    return batch


def test_no_mask_ablation_trains_on_observations_in_the_actor_and_its_kl_loss(ray_cluster):
    cfg = make_cfg(1, **{"algorithm.mask_observations": "false"})
    base = _ablation_batch(cfg)
    obs = (base.batch["response_mask"] == 0) & (base.batch["loss_mask"] == 1)
    m_a, s_a = run_update(cfg, base)
    for key in ("advantages", "ref_log_prob"):  # policy-gradient loss and KL loss, each alone
        other = _ablation_batch(cfg)
        other.batch[key] = torch.where(obs, other.batch[key] - 3.0, other.batch[key])
        m_b, s_b = run_update(cfg, other)
        moved = max(float((s_a[k] - s_b[k]).abs().max()) for k in s_a)
        assert moved > 1e-6, f"{key} at observation positions changed nothing with masking off"
    assert m_a["actor/kl_loss"] != pytest.approx(m_b["actor/kl_loss"], abs=1e-6)


def test_no_mask_ablation_reaches_critic_values_and_advantages(ray_cluster):
    from rsearch_verl.trainer.phases import advantage_phase
    from rsearch_verl.workers.critic import CriticWorker

    for masked in (True, False):
        overrides = {"algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": "true", "critic.optim.lr": "1e-2"}
        cfg = make_cfg(1, **overrides, **{"algorithm.mask_observations": str(masked).lower()})
        batch = make_batch(vocab_size(cfg)) if masked else _ablation_batch(cfg)
        obs = (batch.batch["response_mask"] == 0) & (batch.batch["attention_mask"][:, P:] == 1)
        policy = batch.batch["response_mask"] == 1
        name = f"c{int(masked)}"
        group = start_group(one_pool(cfg, name), CriticWorker, cfg, name)
        try:
            batch = batch.union(group.compute_values(batch))  # the zero-initialised head: all 0
            batch.batch["returns"] = torch.ones(B, R)
            written = reduce_metrics(group.update_critic(batch).meta_info)  # one step towards 1 on the loss mask
            batch.batch["values"] = group.compute_values(batch).batch["values"]
        finally:
            for w in group.workers:
                ray.kill(w)
            for pg in group.resource_pool.pgs or []:
                ray.util.remove_placement_group(pg)
        assert {sig.VF_LOSS, sig.CRITIC_GRAD_NORM} <= written.keys()  # what the health watchdog reads
        t = batch.batch
        assert t["values"][policy].abs().min() > 0, "the critic update did not move the values"
        t["token_level_scores"] = torch.zeros(B, R)
        t["token_level_scores"][:, 2] = 1.0
        t["old_log_probs"] = t["ref_log_prob"] + 0.5  # a KL penalty on every position the mask admits
        batch.non_tensor_batch["uid"] = np.array([f"u{i}" for i in range(B)], dtype=object)
        batch, _ = advantage_phase(batch, cfg, step=1)
        penalty = t["token_level_rewards"] - t["token_level_scores"]
        checks = {
            "values": t["values"],
            "KL-in-reward": penalty,
            "advantages": t["advantages"],
            "returns": t["returns"],
        }
        for key, tensor in checks.items():
            at_obs = float(tensor[obs].abs().max())
            assert (at_obs > 0) == (not masked), f"{key} at observation positions: {at_obs} (masked={masked})"


def _start(cfg, name: str):
    from rsearch_verl.workers.actor import ActorWorker

    return start_group(one_pool(cfg, name), ActorWorker, cfg, name, with_rollout=False)


def _stop(group) -> None:
    for w in group.workers:
        ray.kill(w)
    for pg in group.resource_pool.pgs or []:
        ray.util.remove_placement_group(pg)


def _assert_same(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0 if atol == 0 else 1e-4, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_checkpoint_reshards_between_world_sizes(ray_cluster, tmp_path):
    """A checkpoint written by 1 rank loads on 2 (and back) with the same parameters and optimizer state: the next
    update from the loaded state equals the one the writer makes (as 1 and 2 ranks do from equal states)."""
    cfg1, cfg2 = make_cfg(1), make_cfg(2)
    first, second = make_batch(vocab_size(cfg1), seed=0), make_batch(vocab_size(cfg1), seed=1)
    one = _start(cfg1, "ck1")
    try:
        one.update_actor(first)
        one.save_checkpoint(str(tmp_path / "by1"))
        saved = one.full_state_dict()[0]
        one.update_actor(second)
        continued = one.full_state_dict()[0]
    finally:
        _stop(one)
    two = _start(cfg2, "ck2")
    try:
        two.load_checkpoint(str(tmp_path / "by1"))
        _assert_same(two.full_state_dict()[0], saved)  # exactly the written parameters, now in 2 shards
        two.update_actor(second)  # Adam moments and step count came along: the same update as the writer's
        after = two.full_state_dict()[0]
        two.save_checkpoint(str(tmp_path / "by2"))
    finally:
        _stop(two)
    _assert_same(after, continued, atol=5e-5)  # summation order only (see test_two_ranks_equal_one_rank)
    back = _start(cfg1, "ck3")
    try:
        back.load_checkpoint(str(tmp_path / "by2"))
        _assert_same(back.full_state_dict()[0], after)
    finally:
        _stop(back)
