"""The one configuration schema of rsearch-verl: a dataclass tree, defaults in one place, validated once, then frozen.

Hydra composes `recipes/config.yaml` (groups model / data / retriever / rollout / trainer, plus `+recipe=...`)
on top of this schema (registered as `rsearch_schema`); `main.py` converts the result with `from_omegaconf`
and calls `validate`, which raises `ConfigError` with a message naming the key for any impossible setting and then
freezes the tree: assigning any key afterwards raises `ConfigError` naming it (lists become tuples, mappings
read-only). Values only known while a run starts (the toy world's tokenizer, the warm start, the own retrieval
server's URL) are not written into it: rsearch_verl/run_context.py derives the run's config from them, once.
Code elsewhere reads typed attributes (`cfg.actor.optim.lr`) and never `.get(key, default)`.

The package, split by concern: schema.py (the dataclasses, one per section), validation.py (`validate`: every name
checked against the registry that owns it), loading.py (Hydra / OmegaConf / dicts). Everything public is re-exported
here: `from rsearch_verl.config import X`.

Usage:
    cfg = from_omegaconf(omegaconf_cfg)   # -> RSearchConfig, validated and frozen
    cfg = load_config(overrides=["+recipe=search_r1_grpo", "trainer.total_steps=2"])  # tests / notebooks
    load_config()                          # ConfigError: no recipe given: compose one with +recipe=NAME (...)
    variant = validate(dataclasses.replace(cfg, seed=2))   # a changed copy is validated (and frozen) again
"""

from rsearch_verl.config.loading import (
    RECIPES_DIR,
    REDACTED,
    check_override_keys,
    from_omegaconf,
    load_config,
    public_dict,
    recipe_names,
    register_schema,
    to_dict,
    unknown_key_message,
)
from rsearch_verl.config.schema import (
    ATTN_IMPLEMENTATIONS,
    CONTEXT_STRATEGIES,
    DATA_SOURCES,
    LORA_TARGETS,
    PLACEMENTS,
    SFT_SCHEDULES,
    ActorConfig,
    AlgorithmConfig,
    BreakerConfig,
    ContextConfig,
    CriticConfig,
    DataConfig,
    JudgeConfig,
    ModelConfig,
    OffPolicyConfig,
    OptimConfig,
    RetrieverConfig,
    RewardConfig,
    RolloutConfig,
    RSearchConfig,
    SFTConfig,
    SupervisorConfig,
    TinyModelConfig,
    ToyWorldConfig,
    TrainerConfig,
    WarmStartConfig,
    WatchdogConfig,
)
from rsearch_verl.config.validation import validate, validate_sft
from rsearch_verl.frozen import ConfigError

__all__ = [
    "CONTEXT_STRATEGIES",
    "ContextConfig",
    "ATTN_IMPLEMENTATIONS",
    "DATA_SOURCES",
    "LORA_TARGETS",
    "PLACEMENTS",
    "RECIPES_DIR",
    "REDACTED",
    "SFT_SCHEDULES",
    "ActorConfig",
    "AlgorithmConfig",
    "BreakerConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "JudgeConfig",
    "ModelConfig",
    "OffPolicyConfig",
    "OptimConfig",
    "RSearchConfig",
    "RetrieverConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "SupervisorConfig",
    "TinyModelConfig",
    "ToyWorldConfig",
    "TrainerConfig",
    "WarmStartConfig",
    "WatchdogConfig",
    "check_override_keys",
    "from_omegaconf",
    "load_config",
    "public_dict",
    "recipe_names",
    "register_schema",
    "to_dict",
    "unknown_key_message",
    "validate",
    "validate_sft",
]
