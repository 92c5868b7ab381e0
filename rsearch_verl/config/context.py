"""The context budget of a rollout: how many positions the model has, and the checks that a recipe's turn, observation
and context budgets fit them (rollout.context, docs/long_horizon.md).

`model_context(cfg)` is the model's positions: `model.max_context` when set, else the tiny policy's
`model.tiny.max_position_embeddings`, else a local HF directory's `config.json` (`max_position_embeddings`); None
when unknown (a hub name or a GGUF file: then only the recipe's own budget is checked, and the engine's limit holds).
`context_budget(cfg)` is the tokens one generation may see, its own new tokens included.

    budget = context_budget(cfg)            # rollout.context.max_tokens, or the model's context
    check_context(cfg)                      # ConfigError naming the keys when a budget cannot fit
"""

from __future__ import annotations

import json
import os

from rsearch_verl.config.schema import CONTEXT_STRATEGIES, RSearchConfig
from rsearch_verl.frozen import ConfigError


def model_context(cfg: RSearchConfig) -> int | None:
    """Positions the policy can attend to (see the module docstring); None when it cannot be known here."""
    model = cfg.model
    if model.max_context > 0:
        return model.max_context
    if model.path == "tiny":
        return model.tiny.max_position_embeddings
    config = os.path.join(os.path.expanduser(model.path), "config.json")
    if not model.gguf_file and os.path.isfile(config):
        with open(config) as f:
            positions = json.load(f).get("max_position_embeddings")
        return int(positions) if positions else None
    return None


def context_budget(cfg: RSearchConfig) -> int | None:
    """The tokens one generation may see, new tokens included (rollout.context.max_tokens, else the model's)."""
    return cfg.rollout.context.max_tokens or model_context(cfg)


def _source(cfg: RSearchConfig) -> str:
    if cfg.model.max_context > 0:
        return "model.max_context"
    return "model.tiny.max_position_embeddings" if cfg.model.path == "tiny" else "the model's config.json"


def check_context(cfg: RSearchConfig) -> None:
    """Raise ConfigError (naming the keys) when the recipe's budgets cannot fit the model's context."""
    ctx, rc = cfg.rollout.context, cfg.rollout
    if ctx.strategy not in CONTEXT_STRATEGIES:
        raise ConfigError(f"rollout.context.strategy: {ctx.strategy!r} is not one of {list(CONTEXT_STRATEGIES)}")
    if ctx.max_tokens < 0 or ctx.keep_recent_turns < 0 or ctx.summary_max_tokens < 1:
        raise ConfigError("rollout.context: max_tokens and keep_recent_turns must be >= 0, summary_max_tokens >= 1")
    positions, budget = model_context(cfg), context_budget(cfg)
    if positions is not None and budget > positions:
        raise ConfigError(
            f"rollout.context.max_tokens: {budget} tokens of context do not fit the model's {positions} "
            f"positions ({_source(cfg)})"
        )
    row = cfg.data.max_prompt_length + rc.max_response_length
    if positions is not None and row > positions:
        raise ConfigError(
            f"data.max_prompt_length + rollout.max_response_length: {cfg.data.max_prompt_length} + "
            f"{rc.max_response_length} = {row} tokens do not fit the model's {positions} positions ({_source(cfg)}); "
            "lower rollout.max_response_length (with rollout.context.strategy=drop_observations or summary a "
            "trajectory continues in new rows once its context is full)"
        )
    if budget is None:
        return
    if cfg.data.max_prompt_length + rc.max_tokens_per_turn > budget:
        raise ConfigError(
            f"rollout.context.max_tokens: a prompt (data.max_prompt_length={cfg.data.max_prompt_length}) and one turn "
            f"(rollout.max_tokens_per_turn={rc.max_tokens_per_turn}) do not fit the budget of {budget} tokens"
        )
    if ctx.strategy != "none":  # after a fold the context must hold the prompt, a turn and its observation
        turn = rc.max_tokens_per_turn + rc.max_obs_length + (ctx.summary_max_tokens if ctx.strategy == "summary" else 0)
        parts = "rollout.max_tokens_per_turn + rollout.max_obs_length" + (
            " + rollout.context.summary_max_tokens" if ctx.strategy == "summary" else ""
        )
        if turn > min(budget - cfg.data.max_prompt_length, rc.max_response_length):
            raise ConfigError(
                f"rollout.context.max_tokens / rollout.max_response_length: a fold keeps room for one turn and its "
                f"observation ({parts} = {turn} tokens); the context left after the prompt "
                f"(rollout.context.max_tokens - data.max_prompt_length = {budget - cfg.data.max_prompt_length}) and "
                f"the row (rollout.max_response_length = {rc.max_response_length}) must each hold them"
            )
    if ctx.strategy != "none" and cfg.actor.loss_agg_mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        raise ConfigError(
            f"actor.loss_agg_mode: {cfg.actor.loss_agg_mode} weighs every row alike, and a folded trajectory is "
            "several rows (it would count once per fold); use token-mean or seq-mean-token-sum-norm with "
            f"rollout.context.strategy={ctx.strategy}"
        )
