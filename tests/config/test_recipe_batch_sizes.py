"""The GPU trainer groups carry each recipe's paper batch sizes; the CPU default keeps its small sizes.

Every recipe x {3B instruct, 7B base} x {one 8-GPU node, two nodes} composes with rollout=vllm, validates, and gets
its own numbers (recipes/batch/<recipe>_gpu_1x8.yaml; the trainer group sets none), not the model's. The Qwen3 and
Llama 3 model groups, and Qwen3.5 / 3.6's (hybrids: padded, not packed, micro-batches on the GPU groups), compose with
every recipe on the GPU and CPU trainer groups (hub names: composed and validated, never loaded), their tiny stand-ins
(model=tiny_qwen3 / tiny_llama3 / tiny_qwen3_5 / tiny_qwen3_6_moe) on the CPU ones.

    .venv/bin/python -m pytest -q tests/config/test_recipe_batch_sizes.py
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os

import pytest

from rsearch_verl.config import TrainerConfig, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(os.path.basename(p)[: -len(".yaml")] for p in glob.glob(os.path.join(ROOT, "recipes/recipe/*.yaml")))

# the papers' numbers: (prompts per step, rollout.n, trajectories per optimizer step, per-GPU micro-batch)
SEARCH_R1_GRPO = (512, 5, 1280, 4)  # 512 prompts, mini-batch 256 prompts = 1280 trajectories
PAPER_SIZES = {
    "search_r1_ppo": (512, 1, 256, 4),
    "search_r1_grpo": SEARCH_R1_GRPO,
    "search_r1_drgrpo": SEARCH_R1_GRPO,
    "search_r1_toolcall_grpo": SEARCH_R1_GRPO,
    "research_grpo": (256, 5, 640, 4),
    "r1_searcher_rpp": (64, 16, 256, 4),  # rollout batch 64 prompts x 16, train batch 256 samples
    "r_search_grpo": (256, 5, 640, 4),
    "r_search_ppo": (256, 1, 128, 4),
    "r_search_dag_grpo": (8, 4, 32, 1),  # 1 per device x 4 accumulation steps on 8 GPUs, M = 4
    "deep_search_grpo": (128, 8, 512, 4),  # long-horizon agents (docs/long_horizon.md): no paper; ASearcher-like
}
GPU = ["rollout=vllm", "trainer=gpu_1x8"]
# a GPU run's model: the tiny CPU policy's 2048 positions cannot hold vLLM's 4096-token responses (refused)
GPU_MODEL = ["model=qwen2_5_3b_instruct", *GPU]


def test_every_recipe_has_paper_sizes():
    assert RECIPES and sorted(PAPER_SIZES) == RECIPES


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("model", ["qwen2_5_3b_instruct", "qwen2_5_7b_base"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_on_gpus_gets_its_paper_sizes(recipe, model, nodes):
    cfg = load_config([f"+recipe={recipe}", f"model={model}", *GPU, f"trainer.nnodes={nodes}"])
    assert cfg.world_size == 8 * nodes
    prompts, n, mini, micro = PAPER_SIZES[recipe]
    assert (cfg.data.train_batch_size, cfg.rollout.n) == (prompts, n)
    assert (cfg.actor.ppo_mini_batch_size, cfg.actor.micro_batch_size) == (mini, micro)
    if cfg.use_critic:
        assert cfg.critic.ppo_mini_batch_size == mini
    # padding-free training with flash-attention on GPU; the model group's learning rate survives
    assert cfg.actor.use_remove_padding and cfg.critic.use_remove_padding
    assert cfg.model.attn_implementation == "flash_attention_2" and cfg.model.dtype == "bfloat16"
    assert cfg.actor.optim.lr == 1e-6


def test_command_line_beats_the_recipe_sizes():
    cfg = load_config(
        ["+recipe=search_r1_grpo", *GPU_MODEL, "data.train_batch_size=128", "actor.ppo_mini_batch_size=640"]
    )
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size) == (128, 640)
    sdpa = load_config(["+recipe=search_r1_ppo", *GPU_MODEL, "model.attn_implementation=sdpa"])
    assert sdpa.model.attn_implementation == "sdpa" and sdpa.actor.use_remove_padding


@pytest.mark.parametrize("recipe", ["search_r1_grpo", "r1_searcher_rpp", "r_search_ppo"])
def test_single_gpu_smoke_group(recipe):
    cfg = load_config([f"+recipe={recipe}", "model=qwen2_5_3b_instruct", "rollout=vllm", "trainer=gpu_1x1"])
    assert cfg.world_size == 1 and cfg.data.train_batch_size == 8 and cfg.trainer.total_steps == 5


@pytest.mark.skipif(
    "rollout_gpus_per_node" not in {f.name for f in dataclasses.fields(TrainerConfig)},
    reason="trainer.rollout_gpus_per_node (split placement on GPUs) is not in the schema yet",
)
def test_split_placement_counts_the_training_gpus():
    # split gives each node's rollout_gpus_per_node to the rollout; the papers' power-of-two sizes need 4 of 8 to train
    split = [*GPU_MODEL, "trainer.placement=split"]
    cfg = load_config(["+recipe=search_r1_ppo", *split, "trainer.rollout_gpus_per_node=4", "trainer.nnodes=2"])
    assert cfg.world_size == 8 and cfg.data.train_batch_size == 512
    six = ["data.train_batch_size=480", "actor.ppo_mini_batch_size=240", "critic.ppo_mini_batch_size=240"]
    cfg = load_config(["+recipe=search_r1_ppo", *split, "trainer.rollout_gpus_per_node=2", *six])
    assert cfg.world_size == 6  # the docs/cluster.md example for 2 rollout GPUs per node


# data.train_batch_size, actor/critic ppo_mini_batch_size and micro_batch_size, read on main before the GPU groups
# carried sizes: the toy world's 16 prompts, verl-style mini-batches of 4 trajectories, micro-batches of 2
CPU_SIZES = (16, 4, 2, 4, 2)


@pytest.mark.parametrize("trainer", ["cpu", "cpu2"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_cpu_keeps_its_small_sizes(recipe, trainer):
    cfg = load_config([f"+recipe={recipe}", f"trainer={trainer}"])
    got = (
        cfg.data.train_batch_size,
        cfg.actor.ppo_mini_batch_size,
        cfg.actor.micro_batch_size,
        cfg.critic.ppo_mini_batch_size,
        cfg.critic.micro_batch_size,
    )
    assert got == CPU_SIZES
    assert (cfg.trainer.device, cfg.trainer.total_steps, cfg.model.path) == ("cpu", 20, "tiny")
    assert not cfg.actor.use_remove_padding and cfg.model.attn_implementation is None


@pytest.mark.parametrize("recipe", RECIPES)
def test_smollm2_on_cpu_gets_20_trajectories_a_step_for_every_recipe(recipe):
    """model=smollm2_135m with trainer=cpu: its CPU sizes (recipes/sizes/smollm2_135m_cpu.yaml: 20 trajectories a
    step, the prompt count following the recipe's rollout.n); every recipe composes and validates."""
    cfg = load_config(["model=smollm2_135m", f"+recipe={recipe}"])
    trajectories = cfg.data.train_batch_size * cfg.rollout.n
    # R1-Searcher keeps its paper's 16 samples, the deep recipe its 8 (5 prompts: whole mini-batches of 10)
    assert trajectories == {"r1_searcher_rpp": 80, "deep_search_grpo": 40}.get(recipe, 20)
    assert (cfg.actor.ppo_mini_batch_size, cfg.model.dtype, cfg.model.sft_checkpoint) == (10, "bfloat16", "auto")
    assert cfg.actor.use_remove_padding and cfg.trainer.total_steps == 20 and cfg.warm_start.n_demos == 256
    gpu = load_config(["model=smollm2_135m", f"+recipe={recipe}", *GPU])  # the specializations are CPU only
    assert gpu.data.train_batch_size == PAPER_SIZES[recipe][0] and gpu.warm_start.n_demos == 2048


def test_prompts_per_step_fills_whole_mini_batches():
    """The resolver recipes/sizes/smollm2_135m_cpu.yaml sizes its prompts by: the fewest prompts that give at least
    the trajectories asked for and fill whole mini-batches."""
    from rsearch_verl.config.loading import prompts_per_step

    assert [prompts_per_step(20, n, 10) for n in (1, 4, 5, 16)] == [20, 5, 4, 5]
    assert prompts_per_step(512, 1, 256) == 512 and prompts_per_step(20, 3, 10) == 10
    with pytest.raises(ValueError):
        prompts_per_step(20, 0, 10)


# the Qwen3 / Llama 3 model groups (rsearch_verl/model_families.py): hub names, composed and validated only (nothing is
# loaded or downloaded here), with their actor learning rate
FAMILY_GROUPS = {
    "qwen3_0_6b": ("qwen3", 2e-6),
    "qwen3_4b": ("qwen3", 1e-6),
    "qwen3_8b": ("qwen3", 1e-6),
    "llama3_2_3b_instruct": ("llama3", 1e-6),
    "llama3_1_8b_instruct": ("llama3", 1e-6),
    "qwen3_5_4b": ("qwen3_5", 1e-6),
    "qwen3_5_9b": ("qwen3_5", 1e-6),
    "qwen3_5_27b": ("qwen3_5", 1e-6),
    "qwen3_6_35b_a3b": ("qwen3_5_moe", 1e-6),
}
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Qwen3.5 / 3.6 (hybrids): the Gated DeltaNet projections too
HYBRID_PROJECTIONS = [*ALL_PROJECTIONS[:4], "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                      *ALL_PROJECTIONS[4:]]  # fmt: skip


@pytest.mark.parametrize("model", sorted(FAMILY_GROUPS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_family_groups_compose_with_every_recipe_on_gpus_and_cpus(recipe, model):
    from rsearch_verl.rollout.protocols import protocol_for

    family, lr = FAMILY_GROUPS[model]
    gpu = load_config([f"+recipe={recipe}", f"model={model}", *GPU])
    prompts, n, mini, micro = PAPER_SIZES[recipe]
    assert (gpu.data.train_batch_size, gpu.rollout.n, gpu.actor.ppo_mini_batch_size) == (prompts, n, mini)
    assert (gpu.model.family, gpu.model.dtype, gpu.actor.optim.lr) == (family, "bfloat16", lr)
    hybrid = family.startswith("qwen3_5")
    lora = HYBRID_PROJECTIONS if hybrid else ALL_PROJECTIONS
    assert gpu.model.use_chat_template and list(gpu.model.lora_target_modules) == lora
    assert gpu.model.thinking is (True if family.startswith("qwen3") else None)
    # hybrids train padded micro-batches (recipes/sizes/<group>_gpu_*.yaml): packing would leak recurrent state
    assert gpu.actor.use_remove_padding is gpu.critic.use_remove_padding is (not hybrid)
    proto = protocol_for(gpu)  # the family's conventions reach the protocol
    if recipe == "search_r1_toolcall_grpo":
        assert proto.format.name == {"llama3": "llama3_json"}.get(family, "qwen3_xml" if hybrid else "hermes")
    if family.startswith("qwen3"):
        assert proto.chat_template_kwargs == {"enable_thinking": True}
    for trainer in ("cpu", "cpu2"):  # composes and validates; the hub model is never loaded on CPU
        cpu = load_config([f"+recipe={recipe}", f"model={model}", f"trainer={trainer}"])
        assert (cpu.trainer.device, cpu.model.path, cpu.model.family) == ("cpu", gpu.model.path, family)


TINY_GROUPS = {"tiny_qwen3": "qwen3", "tiny_llama3": "llama3", "tiny_qwen3_5": "qwen3_5",
               "tiny_qwen3_6_moe": "qwen3_5_moe"}  # fmt: skip


@pytest.mark.parametrize("model", sorted(TINY_GROUPS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_tiny_family_groups_compose_with_every_recipe_on_cpus(recipe, model):
    """The tiny stand-ins are CPU groups: like model=tiny, their positions cannot hold the GPU groups' responses."""
    for trainer in ("cpu", "cpu2"):
        cfg = load_config([f"+recipe={recipe}", f"model={model}", f"trainer={trainer}"])
        assert (cfg.model.path, cfg.model.family, cfg.model.sft_checkpoint) == ("tiny", TINY_GROUPS[model], None)
        assert cfg.model.use_chat_template and cfg.prompt_variant == "instruct"


@pytest.mark.parametrize("policy", [None, "/some/deep_warm_start"])
def test_gpu_smoke_deep_runs_compose(policy):
    # launch/gpu_smoke.py deep_e2e: the random policy's small context, or a carried warm start in the recipe's own world
    spec = importlib.util.spec_from_file_location("gpu_smoke", os.path.join(ROOT, "launch", "gpu_smoke.py"))
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    cfg = load_config(["+recipe=deep_search_grpo", *smoke.deep_overrides("/tmp/w", policy)])
    assert cfg.trainer.device == "cuda" and cfg.model.dtype == "bfloat16" and cfg.rollout.max_turns == 8
    assert cfg.model.sft_checkpoint == policy
    own = load_config(["+recipe=deep_search_grpo"])
    assert (cfg.data.toy_world == own.data.toy_world) == (policy is not None)  # a warm start needs its own world
