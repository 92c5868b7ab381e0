"""Sequence packing and token-budget micro-batches (rsearch_verl/workers/packing.py) equal the padded path.

- in one process, in float64 (so that only an actual difference, not float32 summation order, could show): packed
  log-probs, entropies and values equal the padded ones to 1e-12, and so do the gradients of a loss on them, on a
  tiny GQA Qwen2 with left- and right-padded rows, with transformers' SDPA (packed: block-diagonal mask) and with our
  per-sequence `varlen_sdpa` (rsearch_verl/workers/varlen_attention.py);
- token-budget partitions respect the budget, cover every row once, and `restore_order` undoes them;
- a model whose attention ignores the position-id restarts is refused by `check_remove_padding`;
- through real Ray FSDP workers (2 ranks, gloo, unequal token loads per rank): an actor update (clipped loss + KL loss +
  entropy) with packing and a token budget gives the log-probs, losses, gradient norm and parameters of the padded
  micro-batch path. (The critic worker's packed path runs in tests/workers/test_workers_lora.py.)

Run: .venv/bin/python -m pytest -q tests/workers/test_workers_packing.py
"""

from __future__ import annotations

import copy

import pytest
import torch
from verl import DataProto

from rsearch_verl.config import TinyModelConfig
from rsearch_verl.models import build_tiny_qwen2
from rsearch_verl.workers.critic import ValueModel
from rsearch_verl.workers.forward import check_remove_padding, response_log_probs, response_values
from rsearch_verl.workers.packing import micro_batches, restore_order, token_budget_partitions
from rsearch_verl.workers.varlen_attention import VARLEN_SDPA, register_varlen_sdpa, sequence_bounds

CPU = torch.device("cpu")
VOCAB = 300


def padded_batch(lengths: list[tuple[int, int]], p: int, r: int, seed: int = 0) -> DataProto:
    """Rows with (prompt, response) real lengths: prompts left-padded to p, responses right-padded to r."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    ids = torch.randint(3, VOCAB, (b, p + r), generator=g)
    attn = torch.zeros(b, p + r, dtype=torch.long)
    for i, (lp, lr) in enumerate(lengths):
        attn[i, p - lp : p + lr] = 1
    ids = ids * attn  # padding id 0, as a real batch has it
    tensors = {
        "input_ids": ids,
        "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, p:],
        "loss_mask": attn[:, p:].clone(),
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": 0.7})


@pytest.fixture(scope="module", params=["sdpa", VARLEN_SDPA])
def lm(request):
    """The tiny GQA model on transformers' SDPA (packed: a block-diagonal mask) or on our per-sequence varlen SDPA."""
    shape = TinyModelConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    model = build_tiny_qwen2(shape, VOCAB, seed=3, dtype=torch.float64)
    register_varlen_sdpa()
    model.set_attn_implementation(request.param)
    return model


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(g0: dict, g1: dict) -> None:
    assert g0.keys() == g1.keys() and len(g0) > 10
    for name in g0:
        scale = float(g0[name].abs().max())
        assert scale > 0, f"{name} got no gradient"
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-12 * scale, msg=lambda m, n=name: f"{n}: {m}")


def test_packed_log_probs_entropy_and_gradients_equal_padded(lm):
    data = padded_batch([(5, 9), (2, 3), (6, 1), (1, 9)], p=6, r=9)
    mask = data.batch["loss_mask"].bool()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = {}
    for rmpad in (False, True):
        lm.zero_grad(set_to_none=True)
        lp, ent = response_log_probs(lm, data, CPU, with_entropy=True, remove_padding=rmpad)
        loss = ((lp * weights - 0.1 * ent) * mask).sum() / mask.sum()
        loss.backward()
        out[rmpad] = (lp.detach(), ent.detach(), loss.item(), _grads(lm))
    (lp0, ent0, loss0, g0), (lp1, ent1, loss1, g1) = out[False], out[True]
    torch.testing.assert_close(lp1[mask], lp0[mask], rtol=0, atol=1e-12)
    torch.testing.assert_close(ent1[mask], ent0[mask], rtol=0, atol=1e-12)
    # positions whose predicting column is padding are never computed: exact zeros
    idle = data.batch["attention_mask"][:, 5:-1] == 0
    assert idle.any() and (lp1[idle] == 0).all() and (ent1[idle] == 0).all()
    assert loss1 == pytest.approx(loss0, rel=1e-12)
    assert_same_grads(g0, g1)


def test_packed_values_and_gradients_equal_padded(lm):
    vm = ValueModel(copy.deepcopy(lm)).to(torch.float64)
    torch.nn.init.normal_(vm.value_head.weight, std=0.5)  # a non-zero head, so the backbone gets gradients
    data = padded_batch([(3, 4), (6, 9), (1, 2)], p=6, r=9, seed=2)
    mask = data.batch["loss_mask"].bool()
    out = {}
    for rmpad in (False, True):
        vm.zero_grad(set_to_none=True)
        values = response_values(vm, data, CPU, remove_padding=rmpad)
        ((values - 1.0) ** 2 * mask).sum().backward()
        out[rmpad] = (values.detach(), _grads(vm))
    (v0, g0), (v1, g1) = out[False], out[True]
    torch.testing.assert_close(v1[mask], v0[mask], rtol=0, atol=1e-12)
    assert_same_grads(g0, g1)


def test_sequence_bounds_follow_position_restarts():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 0, 1, 2, 3]])
    assert sequence_bounds(pos) == [(0, 3), (3, 4), (4, 6), (6, 10)]
    assert sequence_bounds(torch.arange(5)[None]) == [(0, 5)]
    # read once per forward: the same tensor again is not read back (a device -> host sync per layer on a GPU) ...
    pos_again = sequence_bounds(pos)
    assert pos_again == [(0, 3), (3, 4), (4, 6), (6, 10)]
    assert sequence_bounds(pos) is pos_again
    pos[0, 3] = 3  # ... but an in-place change of it, or another tensor with the same values, is
    assert sequence_bounds(pos) == [(0, 4), (4, 6), (6, 10)]
    assert sequence_bounds(pos.clone()) == [(0, 4), (4, 6), (6, 10)]


def test_token_budget_partitions_and_restore_order():
    lengths = [(6, 9), (1, 1), (2, 2), (6, 8), (3, 1), (1, 4), (2, 9), (5, 5)]
    data = padded_batch(lengths, p=6, r=9)
    seqlens = [a + b for a, b in lengths]
    for budget in (15, 20, 40, 200):
        parts = token_budget_partitions(seqlens, budget, CPU)
        assert sorted(i for p in parts for i in p) == list(range(len(seqlens)))
        assert all(sum(seqlens[i] for i in p) <= budget for p in parts)
        assert len(parts) >= -(-sum(seqlens) // budget)
    micros, order = micro_batches(data, micro_batch_size=2, max_token_len=20)
    assert len(micros) > 1 and sorted(order) == list(range(len(data)))
    restored = restore_order(torch.cat([m.batch["input_ids"] for m in micros]), order)
    assert torch.equal(restored, data.batch["input_ids"])
    rows, none = micro_batches(data, micro_batch_size=3, max_token_len=None)
    assert none is None and [len(m) for m in rows] == [3, 3, 2]
    with pytest.raises(ValueError, match="exceeds the micro-batch token budget"):
        token_budget_partitions(seqlens, 14, CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_that_ignores_restarts_is_refused(lm, dtype):
    """float32: packed == padded; bfloat16 (rounding differs between the two paths): packed sequences isolated."""
    lm = copy.deepcopy(lm).to(dtype)
    check_remove_padding(lm, CPU, VOCAB, dtype=dtype)  # the real model passes
    broken = copy.deepcopy(lm)
    # a decoder that numbers the packed row 0..T-1 (as older models do): packed sequences would attend to each other
    inner = broken.model.forward

    def forward_without_restarts(*args, **kwargs):
        if kwargs.get("attention_mask") is None and kwargs.get("position_ids") is not None:
            t = kwargs["position_ids"].shape[1]
            kwargs["position_ids"] = torch.arange(t)[None]
        return inner(*args, **kwargs)

    broken.model.forward = forward_without_restarts
    with pytest.raises(RuntimeError, match="use_remove_padding"):
        check_remove_padding(broken, CPU, VOCAB, dtype=dtype)


# ---------------------------------------------------------------- real Ray FSDP workers (2 ranks, gloo)
RAY_P, RAY_R = 6, 24
# long-tailed responses; rank 0 gets the long rows (3 micro-batches under the budget), rank 1 the short ones (1): the
# ranks must agree on 3
RAY_LENGTHS = [(6, 24), (6, 20), (6, 5), (4, 2), (2, 3), (1, 4), (6, 1), (3, 6)]


def ray_cfg(packed: bool):
    from rsearch_verl.config import load_config

    keys = {
        "use_remove_padding": str(packed).lower(),
        "use_dynamic_bsz": str(packed).lower(),
        "ppo_max_token_len_per_gpu": RAY_P + RAY_R,  # tight: one long row, or a few short ones, per micro-batch
    }
    overrides = [
        "model=tiny",
        "model.sft_checkpoint=null",
        "trainer=cpu",
        "trainer.n_workers=2",
        "data.train_batch_size=8",
        f"data.max_prompt_length={RAY_P}",
        f"rollout.max_response_length={RAY_R}",
        "rollout.n=1",
        "algorithm.adv_estimator=reinforce_plus_plus",
        "actor.ppo_mini_batch_size=8",
        "actor.optim.lr=1e-3",
        "actor.use_kl_loss=true",
        "actor.entropy_coeff=0.01",
        *[f"actor.{k}={v}" for k, v in keys.items()],
    ]
    return load_config(overrides)


def ray_batch(vocab: int) -> DataProto:
    data = padded_batch(RAY_LENGTHS, p=RAY_P, r=RAY_R, seed=5)
    g = torch.Generator().manual_seed(6)
    t = data.batch
    ids = torch.randint(3, vocab, t["input_ids"].shape, generator=g)
    t["input_ids"] = ids * t["attention_mask"]
    t["responses"] = t["input_ids"][:, RAY_P:]
    t["prompts"] = t["input_ids"][:, :RAY_P]
    t["response_mask"] = t["loss_mask"].clone()
    t["advantages"] = torch.randn(t["loss_mask"].shape, generator=g)
    t["ref_log_prob"] = -torch.rand(t["loss_mask"].shape, generator=g) * 4
    data.meta_info = {"kl_coef": 0.1, "temperature": 1.0}
    return data


def run_actor(cfg, batch: DataProto) -> dict:
    import ray
    from pool_helpers import one_pool  # tests/workers/pool_helpers.py

    from rsearch_verl.workers.actor import ActorWorker
    from rsearch_verl.workers.metrics import reduce_metrics
    from rsearch_verl.workers.placement import start_group

    batch = copy.deepcopy(batch)  # DataProto.union writes into the batch
    name = "pk" if cfg.actor.use_remove_padding else "pd"
    group = start_group(one_pool(cfg, name), ActorWorker, cfg, name, with_rollout=False)
    try:
        out = {"old": group.compute_log_prob(batch).batch["old_log_probs"]}
        batch = batch.union(DataProto.from_dict(tensors={"old_log_probs": out["old"]}))
        out["metrics"] = reduce_metrics(group.update_actor(batch).meta_info)
        out["state"] = group.full_state_dict()[0]
    finally:
        for w in group.workers:
            ray.kill(w)
        for pg in group.resource_pool.pgs or []:
            ray.util.remove_placement_group(pg)
    return out


@pytest.mark.slow
def test_packed_token_budget_update_equals_padded_on_fsdp_workers():
    ray = pytest.importorskip("ray")
    from rsearch_verl.workers.generation import build_policy

    padded_cfg, packed_cfg = ray_cfg(False), ray_cfg(True)
    batch = ray_batch(len(build_policy(padded_cfg)[0]))
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False)
    try:
        a, b = run_actor(padded_cfg, batch), run_actor(packed_cfg, batch)
    finally:
        ray.shutdown()
    mask = batch.batch["loss_mask"].bool()
    torch.testing.assert_close(b["old"][mask], a["old"][mask], rtol=0, atol=1e-5)
    # losses are sums over micro-batches with the mini-batch's global denominator: any grouping gives the same
    for key in ("pg_loss", "kl_loss", "entropy", "grad_norm"):
        assert b["metrics"][f"actor/{key}"] == pytest.approx(a["metrics"][f"actor/{key}"], rel=1e-5, abs=1e-7), key
    moved = max(float((a["state"][k] - b["state"][k]).abs().max()) for k in a["state"])
    assert moved < 5e-5  # one Adam step at lr 1e-3; summation order only (sign flips of ~0 gradients cost 2e-3)
