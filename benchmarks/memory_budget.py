"""GPU memory budget per device for the documented GPU runs, from the code's own settings (an estimate, no GPU needed).

    .venv/bin/python benchmarks/memory_budget.py                       # 3B and 7B, PPO and GRPO, 8 GPUs
    .venv/bin/python benchmarks/memory_budget.py --gpus 1 --model qwen2_5_3b_shape --recipe search_r1_grpo \
        --override model.path=tiny --override trainer=gpu_1x1          # compare with the smoke's measured 3B run
    .venv/bin/python benchmarks/memory_budget.py --model qwen3_5_9b --model qwen3_6_35b_a3b   # the hybrids
    .venv/bin/python benchmarks/memory_budget.py --gpus 16 --model qwen3_6_35b_a3b          # 2 nodes

The config of each row is composed exactly as the documented command (`load_config([...])`): world size, rollout.n,
micro-batch, sequence budget, vLLM's gpu_memory_utilization, whether a critic and a reference exist, padding-free
training, the log-prob chunk. Model shapes are the published Qwen2.5 configs; the Qwen3.5 / 3.6 hybrids' text models
(Qwen3.5-9B, Qwen3.6-35B-A3B: shapes from their published configs, no vision tower, no MTP head) are counted exactly by
instantiating transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM on the meta device. Per GPU, FSDP shards every
training state over the world size:

    actor      fp32 master weights + fp32 gradients + AdamW moments (2 x fp32)     16 P / N bytes
    reference  weights in the compute dtype (bf16: no update, so no fp32 master)     2 P / N
    critic     as the actor (backbone + a scalar head)                             16 P / N
    gathered   bf16 weights of the layer being computed and the one prefetched      2 x 2 P_layer
               (MoE: P_layer holds all routed experts: FSDP gathers every expert of a layer, used or not)
    activations  gradient checkpointing: the layer-boundary hidden states (2 L T H bytes) plus one layer recomputed,
               34 T H bytes with flash attention ("Reducing Activation Recomputation in Large Transformer Models")
    logits     log-probs: bf16 logits + fp32 log-softmax + its gradient for the positions in flight: all T of a
               micro-batch before, `actor.logprob_chunk_size` of them after (rsearch_verl/workers/forward.py)
    engine     vLLM: gpu_memory_utilization x the GPU while awake (weights + KV cache), asleep during training after;
               the Hugging Face engine (rollout=hf): its own unsharded bf16 copy, 2 P, always resident
    sync       before: the full fp32 state dict gathered on every rank; after: one bucket (update_weights_bucket_mb)

"before" is the layout this repository had until the GPU-path issue (vLLM awake through training, the full state dict
on every rank at every sync, unchunked log-probs, an fp32 reference); "after" is today's. The last line is before /
after of the worst row's peak ("before" with rollout=vllm's old gpu_memory_utilization, 0.6). T = micro_batch_size x
(data.max_prompt_length + rollout.max_response_length) tokens: padding-free training packs the real tokens, so this
is an upper bound. The activation formula is the attention layers'; a Gated DeltaNet layer's is of the same order.

MoE models also get their FSDP traffic per decoder layer and micro-batch (bf16 all-gather in forward and again in
backward, fp32 reduce-scatter of the gradients; (N-1)/N of each crosses a rank's links) beside what expert parallelism
would move instead (the tokens' hidden states to and from their top-k experts: dispatch + combine, forward + backward).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    def layer_params(self) -> int:
        head_dim = self.hidden // self.heads
        kv = self.kv_heads * head_dim
        attn = self.hidden * self.hidden + self.hidden + 2 * (self.hidden * kv + kv) + self.hidden * self.hidden
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def params(self) -> int:
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params() + emb + self.hidden


@dataclasses.dataclass(frozen=True)
class HybridShape:
    """A Qwen3.5 / 3.6 text model (3 Gated DeltaNet : 1 gated attention; `experts` > 0: the MoE), its parameters
    counted on the meta device. Both published families share the linear-attention shape: 16 key / 32 value heads of
    128, conv 4; full attention head_dim 256."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    experts: int = 0
    experts_per_tok: int = 0
    expert_intermediate: int = 0

    def layer_params(self) -> int:
        return _count(self)[1]

    def params(self) -> int:
        return _count(self)[0]

    def expert_params(self) -> int:
        """The routed experts' parameters (every layer)."""
        return _count(self)[2]

    def active_params(self) -> int:
        """Parameters a token uses: all but the routed experts it is not sent to."""
        unused = self.expert_params() * (self.experts - self.experts_per_tok) // max(1, self.experts)
        return self.params() - unused


@functools.cache
def _count(shape: HybridShape) -> tuple[int, int, int]:
    """(total, largest decoder layer, routed experts) of `shape`'s transformers model, built on the meta device."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers, head_dim=256,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, linear_num_key_heads=16,
                  linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, tie_word_embeddings=shape.tied)  # fmt: skip
    if shape.experts:
        config = Qwen3_5MoeTextConfig(num_experts=shape.experts, num_experts_per_tok=shape.experts_per_tok,
                                      moe_intermediate_size=shape.expert_intermediate,
                                      shared_expert_intermediate_size=shape.expert_intermediate, **common)  # fmt: skip
        cls = Qwen3_5MoeForCausalLM
    else:
        config, cls = Qwen3_5TextConfig(intermediate_size=shape.intermediate, **common), Qwen3_5ForCausalLM
    with torch.device("meta"):
        model = cls(config)
    layer = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    return sum(p.numel() for p in model.parameters()), layer, experts


SHAPES = {  # the published Hugging Face configs
    "qwen2_5_3b_instruct": Shape(2048, 36, 16, 2, 11008, 151936, True),
    "qwen2_5_7b_base": Shape(3584, 28, 28, 4, 18944, 152064, False),
    # the smoke's random model: Qwen2.5-3B's shape with the toy world's small vocabulary (launch/gpu_smoke.py)
    "qwen2_5_3b_shape": Shape(2048, 36, 16, 2, 11008, 1024, True),
    # Qwen3.5-9B: 32 layers (8 full attention), 16 Q / 4 KV heads; Qwen3.6-35B-A3B: 40 layers (10 full attention),
    # 16 Q / 2 KV heads, 256 routed experts (8 a token) of 512 plus a shared one of 512; both a 248,320-row vocabulary
    "qwen3_5_9b": HybridShape(4096, 32, 16, 4, 12288, 248320, False),
    "qwen3_6_35b_a3b": HybridShape(2048, 40, 16, 2, 0, 248320, False, 256, 8, 512),
}
GROUPS = ("qwen2_5_3b_instruct", "qwen2_5_7b_base", "qwen3_5_9b", "qwen3_6_35b_a3b")  # shapes with a model group
GPU_GIB = 80.0
CUDA_CONTEXT_GIB = 1.0
OLD_VLLM_SHARE = 0.6  # recipes/rollout/vllm.yaml before the GPU-path issue


def _load(recipe: str, model: str, gpus: int, extra: list[str]):
    from rsearch_verl.config import load_config

    # a shape without a model group runs the tiny policy's config with a Qwen2.5 model's 32k positions
    model_group = [f"model={model}"] if model in GROUPS else ["model.max_context=32768"]
    trainer = ["trainer=gpu_1x8"] if gpus >= 8 else ["trainer=gpu_1x1"]
    nodes = [f"trainer.nnodes={gpus // 8}"] if gpus > 8 else []
    return load_config([f"+recipe={recipe}", *model_group, "rollout=vllm", *trainer, *nodes, *extra])


def budget(cfg, shape: Shape, after: bool) -> dict[str, float]:
    """GiB per GPU by component, and the peaks of the two phases (training, rollout)."""
    n, p, vllm = cfg.world_size, shape.params(), cfg.rollout.engine == "vllm"
    tokens = cfg.actor.micro_batch_size * (cfg.data.max_prompt_length + cfg.rollout.max_response_length)
    chunk = getattr(cfg.actor, "logprob_chunk_size", 0) or tokens
    rows = {
        "actor": 16 * p / n,
        "reference": (4 if not after else 2) * p / n if cfg.use_ref and cfg.model.lora_rank == 0 else 0.0,
        "critic": 16 * p / n if cfg.use_critic else 0.0,
        "gathered": 2 * 2 * shape.layer_params(),
        "activations": 2 * shape.layers * tokens * shape.hidden + 34 * tokens * shape.hidden,
        "logits": (2 + 4 + 4) * (min(chunk, tokens) if after else tokens) * shape.vocab,
        "engine": (cfg.rollout.gpu_memory_utilization if after else OLD_VLLM_SHARE) * GPU_GIB * GIB if vllm else 2 * p,
        "sync": (cfg.rollout.update_weights_bucket_mb << 20) if after else 4 * p,
    }
    out = {k: v / GIB for k, v in rows.items()}
    states = out["actor"] + out["reference"] + out["critic"] + CUDA_CONTEXT_GIB
    work = out["gathered"] + out["activations"] + out["logits"]
    asleep = after and vllm  # vLLM sleeps while the actor trains; the HF engine's copy stays
    out["train_peak"] = states + work + (0.0 if asleep else out["engine"])
    out["rollout_peak"] = states + out["engine"] + out["sync"]
    out["params_b"] = p / 1e9
    return out


def moe_traffic(cfg, shape: HybridShape) -> dict[str, float]:
    """GiB one rank sends / receives per MoE decoder layer and micro-batch: FSDP (all-gather of the bf16 layer in
    forward and backward, reduce-scatter of its fp32 gradient) against expert parallelism's all-to-all of the
    micro-batch's tokens (each to its top-k experts and back, forward and backward; an upper bound: tokens whose expert
    is local stay)."""
    n = cfg.world_size
    tokens = cfg.actor.micro_batch_size * (cfg.data.max_prompt_length + cfg.rollout.max_response_length)
    share = (n - 1) / n
    gather = 2 * shape.layer_params() * share
    return {
        "layer_bf16": 2 * shape.layer_params() / GIB,
        "fsdp_all_gather": 2 * gather / GIB,
        "fsdp_reduce_scatter": 4 * shape.layer_params() * share / GIB,
        "ep_all_to_all": 2 * 2 * tokens * shape.experts_per_tok * shape.hidden * 2 / GIB,
        "tokens": float(tokens),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--model", action="append", help=" | ".join(SHAPES))
    ap.add_argument("--recipe", action="append", help="default: search_r1_ppo and search_r1_grpo")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra overrides")
    args = ap.parse_args(argv)
    models = args.model or ["qwen2_5_3b_instruct", "qwen2_5_7b_base"]
    recipes = args.recipe or ["search_r1_ppo", "search_r1_grpo"]
    cols = ["actor", "reference", "critic", "activations", "logits", "engine", "sync", "train_peak", "rollout_peak"]
    print(f"{'model':<22} {'recipe':<16} {'layout':<7} " + " ".join(f"{c:>12}" for c in cols) + "   (GiB per GPU)")
    worst = (0.0, 0.0)
    for model in models:
        for recipe in recipes:
            cfg = _load(recipe, model, args.gpus, args.override)
            for after in (False, True):
                b = budget(cfg, SHAPES[model], after)
                name = "after" if after else "before"
                print(f"{model:<22} {recipe:<16} {name:<7} " + " ".join(f"{b[c]:>12.1f}" for c in cols))
            before = max(budget(cfg, SHAPES[model], False)[k] for k in ("train_peak", "rollout_peak"))
            now = max(budget(cfg, SHAPES[model], True)[k] for k in ("train_peak", "rollout_peak"))
            worst = max(worst, (before, now))
            shape = SHAPES[model]
            if isinstance(shape, HybridShape) and shape.experts:
                t = moe_traffic(cfg, shape)
                print(f"  {model} {recipe}: {shape.params() / 1e9:.2f}B parameters, {shape.active_params() / 1e9:.2f}B"
                      f" active; per MoE layer and micro-batch ({t['tokens']:.0f} tokens), per rank: FSDP all-gathers"
                      f" {t['fsdp_all_gather']:.2f} GiB (the {t['layer_bf16']:.2f} GiB bf16 layer, all experts, forward"
                      f" + backward) and reduce-scatters {t['fsdp_reduce_scatter']:.2f} GiB; expert parallelism"
                      f" would all-to-all <= {t['ep_all_to_all']:.2f} GiB")  # fmt: skip
    print(f"worst peak per GPU before / after: {worst[0]:.1f} / {worst[1]:.1f} GiB = {worst[0] / worst[1]:.2f}x")


if __name__ == "__main__":
    main()
