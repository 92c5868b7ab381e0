"""Loading the configuration: Hydra composition (`load_config`, `register_schema`), OmegaConf / plain dicts
(`from_omegaconf`, what the workers receive back from `to_dict`), the command line's key check
(`check_override_keys`) and the redacted copy for logs (`public_dict`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from typing import Any

from rsearch_verl.config.schema import RSearchConfig
from rsearch_verl.config.validation import validate
from rsearch_verl.frozen import ConfigError

RECIPES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "recipes")


def from_omegaconf(oc_cfg: Any) -> RSearchConfig:
    """Convert a composed OmegaConf / dict config into a validated RSearchConfig (unknown keys are errors)."""
    # hydra/omegaconf kept out of `import rsearch_verl.config` (light code imports it)
    from omegaconf import OmegaConf

    if not isinstance(oc_cfg, dict):
        oc_cfg = OmegaConf.to_container(oc_cfg, resolve=True)
    cfg = _build(RSearchConfig, oc_cfg, "")
    try:
        return validate(cfg)
    except ConfigError as exc:
        if cfg.recipe != RSearchConfig.recipe:
            raise
        # the schema's defaults alone are no run (e.g. GRPO with one sample per prompt): say what is missing
        raise ConfigError(
            f"no recipe given: compose one with +recipe=NAME ({', '.join(recipe_names())}); without it, {exc}"
        ) from None


def recipe_names(config_dir: str = RECIPES_DIR) -> list[str]:
    """The recipes `+recipe=NAME` can compose (recipes/recipe/*.yaml)."""
    folder = os.path.join(config_dir, "recipe")
    return sorted(name[: -len(".yaml")] for name in os.listdir(folder) if name.endswith(".yaml"))


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or '<root>'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(unknown_key_message(prefix, unknown[0], fields))
    kwargs = {}
    hints = _resolved_hints(cls)
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{prefix}.{name}" if prefix else name)
        elif isinstance(value, list) and "tuple" in str(hint):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    return cls(**kwargs)


def unknown_key_message(prefix: str, key: str, known) -> str:
    """One line naming an unknown key, its close matches and the keys valid at that level."""

    full = f"{prefix}.{key}" if prefix else key
    close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(f'{prefix}.{c}' if prefix else c for c in close)}?" if close else ""
    return f"{full}: unknown key{hint} (known at {prefix or 'the top level'}: {', '.join(sorted(known))})"


def check_override_keys(overrides: list[str], groups: tuple[str, ...] = ()) -> None:
    """Raise ConfigError for a command-line override whose key is not in the schema (`trainer.total_step=2` and
    `+trainer.total_step=2` alike), before Hydra composes anything: Hydra suggests the `+` form for an unknown key,
    and `--cfg job` would print it without validating. `groups` are config group names (their options are files,
    not keys); keys under a mapping-typed field (`rollout.protocol_kwargs.*`) and `hydra.*` are not checked."""
    hints_root = RSearchConfig
    for override in overrides:
        if override.startswith("-") or ("=" not in override and not override.startswith("~")):
            continue  # a flag, or a flag's value (`--cfg job`)
        key = override.split("=", 1)[0].lstrip("+~")
        parts = key.split(".")
        if parts[0] == "hydra" or "/" in key or "@" in key or (len(parts) == 1 and parts[0] in groups):
            continue  # Hydra's own keys, group paths (`hydra/launcher=...`), packages, config group choices
        cls, prefix = hints_root, ""
        for part in parts:
            fields = {f.name for f in dataclasses.fields(cls)}
            if part not in fields:
                raise ConfigError(unknown_key_message(prefix, part, fields))
            hint = _resolved_hints(cls)[part]
            prefix = f"{prefix}.{part}" if prefix else part
            if not dataclasses.is_dataclass(hint):
                break  # a leaf or a free-form mapping: nothing below it to check
            cls = hint


def public_dict(cfg: RSearchConfig) -> dict:
    """`to_dict(cfg)` with secrets redacted: what config.yaml and the metrics logger get (workers get `to_dict`)."""
    out = to_dict(cfg)
    if out["retriever"].get("token"):
        out["retriever"]["token"] = REDACTED
    return out


REDACTED = "<redacted>"


def _resolved_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def to_dict(cfg: RSearchConfig) -> dict:
    """Plain dicts and lists (what Ray workers receive and `from_omegaconf` reads back; what config.yaml holds)."""
    return _plain(dataclasses.asdict(cfg))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def register_schema() -> None:
    """Register the schema with Hydra's ConfigStore so recipes are type-checked while composing, and the recipes'
    resolver (`prompts_per_step`)."""
    # hydra/omegaconf kept out of `import rsearch_verl.config` (light code imports it)
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="rsearch_schema", node=RSearchConfig)
    OmegaConf.register_new_resolver("prompts_per_step", prompts_per_step, replace=True)


def prompts_per_step(trajectories: int, n: int, mini_batch: int) -> int:
    """The fewest prompts a step that give at least `trajectories` trajectories at `n` samples per prompt and fill
    whole mini-batches of `mini_batch` trajectories: how a size group that is about trajectories (e.g.
    recipes/sizes/smollm2_135m_cpu.yaml: 20 a step in mini-batches of 10) fits every recipe's rollout.n
    (`${prompts_per_step:20,${rollout.n},${actor.ppo_mini_batch_size}}`: 20 prompts at n = 1, 4 at n = 5, 5 at
    n = 16)."""
    if n < 1 or mini_batch < 1:
        raise ValueError(f"prompts_per_step: rollout.n ({n}) and the mini-batch ({mini_batch}) must be >= 1")
    prompts = -(-trajectories // n)
    while (prompts * n) % mini_batch:
        prompts += 1
    return prompts


def load_config(overrides: list[str] | None = None, config_dir: str | None = None) -> RSearchConfig:
    """Compose recipes/config.yaml with Hydra overrides outside a Hydra app (tests, notebooks, benchmarks). Without
    `+recipe=NAME` it raises ConfigError saying a recipe is required (the schema's defaults alone are no run)."""
    # hydra kept out of `import rsearch_verl.config` (light code imports it)
    from hydra import compose, initialize_config_dir

    register_schema()
    config_dir = config_dir or RECIPES_DIR
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        oc = compose(config_name="config", overrides=list(overrides or []))
    return from_omegaconf(oc)
