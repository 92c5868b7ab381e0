"""Validation of the configuration (rsearch_verl/config/schema.py): `validate(cfg)` raises `ConfigError` with one line
naming the key for any impossible setting, then freezes the tree (rsearch_verl/frozen.py).

Every name the config accepts is checked against the list that declares it, with the valid ones in the message:
advantage estimators, KL kinds and schedules, loss aggregation modes (rsearch_verl/algos/, which config sits below);
rollout engines, prompt variants, search protocols and rewards with their keyword arguments (rsearch_verl/choices.py
on the bottom floor, which the registries of rsearch_verl/rollout/ and rsearch_verl/rewards/ check they implement,
so config imports neither); data sources (the schema's `DATA_SOURCES`, which rsearch_verl/trainer/data_sources.py
loads). So a misspelt name fails when the config is loaded, not after the warm start and the Ray start-up.
"""

from __future__ import annotations

import logging
from typing import Any

from rsearch_verl.choices import (
    ENGINES,
    HYBRID_FAMILIES,
    MODEL_FAMILIES,
    PROMPT_VARIANTS,
    PROTOCOL_KWARGS,
    REWARD_KWARGS,
    ROUND_TRIP_CHECKS,
    TOOL_NAMES,
)
from rsearch_verl.config.context import check_context
from rsearch_verl.config.schema import (
    ATTN_IMPLEMENTATIONS,
    DATA_SOURCES,
    PLACEMENTS,
    REPLAY_MISSES,
    SFT_SCHEDULES,
    RetrieverConfig,
    RSearchConfig,
    SFTConfig,
    ToyWorldConfig,
    TrainerConfig,
    WarmStartConfig,
)
from rsearch_verl.frozen import ConfigError, freeze
from rsearch_verl.plugins import check_import_path, is_import_path

logger = logging.getLogger("rsearch_verl.config")


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _one_of(value: Any, allowed: tuple, key: str) -> None:
    _check(value in allowed, key, f"{value!r} is not one of {list(allowed)}")


def validate(cfg: RSearchConfig) -> RSearchConfig:
    """Raise ConfigError for impossible settings; otherwise freeze cfg (in place) and return it."""
    _validate_algorithm(cfg)
    _validate_names(cfg)
    _validate_workers(cfg)
    _validate_batches(cfg)
    _validate_lora_and_packing(cfg)
    _validate_rollout(cfg)
    _validate_health(cfg)
    _validate_warm_start(cfg.warm_start)
    _validate_toy_world(cfg.data.toy_world)
    _validate_async(cfg)
    check_context(cfg)  # rollout.context: the budgets against the model's positions
    return freeze(cfg)


def _validate_algorithm(cfg: RSearchConfig) -> None:
    # the algorithm tables own their names: config accepts exactly what they implement (imported here: algos
    # imports verl/torch, kept out of the config package's import)
    from rsearch_verl.algos.advantages import ADVANTAGE_ESTIMATORS
    from rsearch_verl.algos.kl import KL_KINDS, KL_SCHEDULES
    from rsearch_verl.algos.losses import LOSS_AGG_MODES

    _one_of(cfg.algorithm.adv_estimator, tuple(ADVANTAGE_ESTIMATORS), "algorithm.adv_estimator")
    _one_of(cfg.algorithm.kl_penalty, tuple(KL_KINDS), "algorithm.kl_penalty")
    _one_of(cfg.actor.kl_loss_type, tuple(KL_KINDS), "actor.kl_loss_type")
    _one_of(cfg.algorithm.kl_schedule, KL_SCHEDULES, "algorithm.kl_schedule")
    _one_of(cfg.actor.loss_agg_mode, LOSS_AGG_MODES, "actor.loss_agg_mode")
    _one_of(cfg.critic.loss_agg_mode, LOSS_AGG_MODES, "critic.loss_agg_mode")
    if cfg.actor.loss_scale_factor is not None:
        _check(cfg.actor.loss_scale_factor > 0, "actor.loss_scale_factor", "must be > 0 (or null)")
    if cfg.algorithm.adv_estimator in ("drgrpo", "dr_grpo") and cfg.actor.loss_agg_mode != "seq-mean-token-sum-norm":
        logger.warning(
            "Dr.GRPO advantages with actor.loss_agg_mode=%s: Dr.GRPO also drops the per-sequence length "
            "normalisation (seq-mean-token-sum-norm, recipe search_r1_drgrpo)",
            cfg.actor.loss_agg_mode,
        )


def _validate_names(cfg: RSearchConfig) -> None:
    """The names of data, engine, placement, device and dtype; then the protocol's and the reward's (with their
    keyword arguments), each against the list that declares it."""
    _one_of(cfg.data.source, DATA_SOURCES, "data.source")
    if is_import_path(cfg.rollout.engine):  # a plug-in engine (rsearch_verl/plugins.py)
        try:
            check_import_path(cfg.rollout.engine, "rollout.engine")
        except ValueError as err:
            raise ConfigError(str(err)) from err
    else:
        _one_of(cfg.rollout.engine, ENGINES, "rollout.engine")
    _one_of(cfg.rollout.prompt_variant, PROMPT_VARIANTS, "rollout.prompt_variant")
    _one_of(cfg.trainer.placement, PLACEMENTS, "trainer.placement")
    _one_of(cfg.trainer.device, ("cpu", "cuda"), "trainer.device")
    _one_of(cfg.model.dtype, ("float32", "bfloat16"), "model.dtype")  # float16 would need loss scaling
    if cfg.model.family is not None:
        _one_of(cfg.model.family, MODEL_FAMILIES, "model.family")
    _one_of(cfg.model.thinking, (None, True, False), "model.thinking")
    _one_of(cfg.rollout.round_trip_check, ROUND_TRIP_CHECKS, "rollout.round_trip_check")
    _validate_protocol(cfg.rollout.protocol, dict(cfg.rollout.protocol_kwargs))
    _validate_tools(list(cfg.rollout.tools))
    _validate_reward(cfg.reward.name, dict(cfg.reward.kwargs))


def _validate_protocol(name: str, kwargs: dict[str, Any]) -> None:
    _one_of(name, tuple(sorted(PROTOCOL_KWARGS)), "rollout.protocol")
    accepted = list(PROTOCOL_KWARGS[name])
    unknown = sorted(set(kwargs) - set(accepted))
    _check(not unknown, "rollout.protocol_kwargs", f"{name} takes no {unknown}; it accepts {accepted}")


def _validate_tools(names: list[str]) -> None:
    """`rollout.tools`: built-in names or plug-in import paths (the module must exist), `search` among them, no name
    twice (a plug-in's own tool name is checked when the rollout builds it: rsearch_verl/rollout/tools/base.py)."""
    _check(all(isinstance(n, str) for n in names), "rollout.tools", f"must be a list of names, got {names!r}")
    for name in names:
        if is_import_path(name):
            try:
                check_import_path(name, "rollout.tools")
            except ValueError as err:
                raise ConfigError(str(err)) from err
        else:
            _one_of(name, TOOL_NAMES, "rollout.tools")
    _check("search" in names, "rollout.tools", f"every protocol searches: 'search' must be one of {names}")
    _check(len(set(names)) == len(names), "rollout.tools", f"a tool is listed twice in {names}")


def _validate_reward(name: str, kwargs: dict[str, Any]) -> None:
    _one_of(name, tuple(sorted(REWARD_KWARGS)), "reward.name")
    accepted = list(REWARD_KWARGS[name])
    unknown = sorted(set(kwargs) - set(accepted))
    _check(not unknown, "reward.kwargs", f"{name} takes no {unknown}; it accepts {accepted}")


def _validate_workers(cfg: RSearchConfig) -> None:
    # heavy: algos imports verl/torch, kept out of the config package's import
    from rsearch_verl.algos.advantages import GROUP_ESTIMATORS

    _check(cfg.actor.logprob_chunk_size >= 1, "actor.logprob_chunk_size", "must be >= 1")
    _check(cfg.trainer.nccl_timeout_s > 0, "trainer.nccl_timeout_s", "must be > 0")
    if cfg.algorithm.adv_estimator == "gae":
        _check(cfg.use_critic, "critic.enable", "PPO with GAE advantages needs a critic (critic.enable=false)")
    _check(cfg.trainer.total_steps >= 0, "trainer.total_steps", "must be >= 0")
    _validate_placement(cfg.trainer)
    _check(cfg.world_size >= 1, "trainer.n_workers / n_gpus_per_node", "at least one worker is needed")
    _check(cfg.rollout.n >= 1, "rollout.n", "must be >= 1")
    _check(cfg.rollout.update_weights_bucket_mb >= 1, "rollout.update_weights_bucket_mb", "must be >= 1")
    if cfg.algorithm.adv_estimator in GROUP_ESTIMATORS:
        _check(cfg.rollout.n >= 2, "rollout.n", f"{cfg.algorithm.adv_estimator} needs a group of >= 2 samples")


def _validate_batches(cfg: RSearchConfig) -> None:
    """Each role's mini-batches divide the step's trajectories, split evenly over the workers into micro-batches."""
    n_traj = cfg.data.train_batch_size * cfg.rollout.n
    for role in ("actor", "critic"):
        sub = getattr(cfg, role)
        if role == "critic" and not cfg.use_critic:
            continue
        key = f"{role}.ppo_mini_batch_size"
        _check(sub.ppo_mini_batch_size >= 1, key, "must be >= 1")
        _check(
            n_traj % sub.ppo_mini_batch_size == 0,
            key,
            f"data.train_batch_size * rollout.n = {n_traj} trajectories is not divisible by {sub.ppo_mini_batch_size}",
        )
        _check(
            sub.ppo_mini_batch_size % cfg.world_size == 0,
            key,
            f"{sub.ppo_mini_batch_size} is not divisible by the {cfg.world_size} workers",
        )
        per_worker = sub.ppo_mini_batch_size // cfg.world_size
        _check(
            per_worker % sub.micro_batch_size == 0,
            f"{role}.micro_batch_size",
            f"{sub.micro_batch_size} does not divide the {per_worker} trajectories per worker per mini-batch",
        )
    _check(n_traj % cfg.world_size == 0, "data.train_batch_size", f"{n_traj} trajectories vs {cfg.world_size} workers")


def _validate_rollout(cfg: RSearchConfig) -> None:
    _check(cfg.rollout.max_turns >= 1, "rollout.max_turns", "must be >= 1")
    _check(cfg.rollout.temperature > 0, "rollout.temperature", "training samples must be > 0 (greedy is val only)")
    _check(cfg.rollout.max_response_length >= 1, "rollout.max_response_length", "must be >= 1")
    _check(cfg.rollout.round_trip_sample >= -1, "rollout.round_trip_sample", "must be >= 0 (-1: every trajectory)")
    if cfg.model.thinking is not None:
        _check(cfg.model.use_chat_template, "model.thinking", "is read by the chat template: needs use_chat_template")
    if cfg.trainer.device == "cuda":
        _check(cfg.trainer.n_gpus_per_node >= 1, "trainer.n_gpus_per_node", "device=cuda needs >= 1 GPU per node")


def validate_sft(sft: SFTConfig, key: str) -> None:
    _one_of(sft.schedule, SFT_SCHEDULES, f"{key}.schedule")
    for name in ("epochs", "warmup_steps"):
        _check(getattr(sft, name) >= 0, f"{key}.{name}", "must be >= 0")
    for name in ("batch_size", "max_length"):
        _check(getattr(sft, name) >= 1, f"{key}.{name}", "must be >= 1")
    _check(sft.lr > 0, f"{key}.lr", "must be > 0")


def _validate_toy_world(tw: ToyWorldConfig) -> None:
    for name in ("two_hop_share", "three_hop_share"):
        _check(0 <= getattr(tw, name) <= 1, f"data.toy_world.{name}", "must be in [0, 1]")
    shares = tw.two_hop_share + tw.three_hop_share + tw.deep_share
    _check(tw.deep_share >= 0 and shares <= 1, "data.toy_world.deep_share", "with two_ and three_hop_share: <= 1")
    _check(0 <= tw.distractors <= 1, "data.toy_world.distractors", "must be in [0, 1] (twins per entity)")
    _check(tw.facts_per_passage >= 1, "data.toy_world.facts_per_passage", "must be >= 1")
    _check(tw.context_sentences >= 0, "data.toy_world.context_sentences", "must be >= 0")


def _validate_warm_start(ws: WarmStartConfig) -> None:
    validate_sft(ws.sft, "warm_start.sft")
    for name in ("copy_p_no_search", "p_no_search", "until_em", "mix_keeps_em"):
        _check(0 <= getattr(ws, name) <= 1, f"warm_start.{name}", "must be in [0, 1]")
    for name in ("n_demos", "copy_epochs", "probe_questions"):
        _check(getattr(ws, name) >= 1, f"warm_start.{name}", "must be >= 1")
    _check(ws.mix_epochs >= 0 and ws.min_searched >= 0, "warm_start.mix_epochs / min_searched", "must be >= 0")
    _check(ws.copy_lr > 0 and ws.mix_lr > 0, "warm_start.copy_lr / mix_lr", "must be > 0")


def _validate_placement(tr: TrainerConfig) -> None:
    """cuda + split: each node's GPUs divide into the rollout pool and the training pool, each >= 1."""
    _check(tr.nnodes >= 1, "trainer.nnodes", "must be >= 1")
    _check(tr.placement_timeout_s > 0, "trainer.placement_timeout_s", "must be > 0")
    if tr.device != "cuda":  # CPU: trainer.n_workers ranks spread evenly over trainer.nnodes nodes
        _check(
            tr.n_workers % tr.nnodes == 0,
            "trainer.n_workers / trainer.nnodes",
            f"trainer.n_workers={tr.n_workers} does not divide evenly over trainer.nnodes={tr.nnodes} nodes",
        )
    threads = str(tr.cpu_threads)
    _check(threads in ("ray", "auto") or (threads.isdigit() and int(threads) >= 1), "trainer.cpu_threads",
           f"{threads!r}: one of ray | auto | a number of threads >= 1")  # fmt: skip
    if tr.device != "cuda" or tr.placement != "split":
        return
    _check(
        1 <= tr.rollout_gpus_per_node < tr.n_gpus_per_node,
        "trainer.rollout_gpus_per_node",
        f"{tr.rollout_gpus_per_node} with trainer.n_gpus_per_node={tr.n_gpus_per_node}: trainer.placement=split needs "
        ">= 1 rollout GPU and >= 1 training GPU per node (e.g. 2 of 8: 6 train, 2 generate)",
    )


def _validate_async(cfg: RSearchConfig) -> None:
    # heavy: algos imports verl/torch, kept out of the config package's import
    from rsearch_verl.algos.off_policy import OFF_POLICY_MODES

    tr = cfg.trainer
    _check(tr.max_staleness >= 0, "trainer.max_staleness", "must be >= 0 (0 = synchronous)")
    _one_of(tr.mid_trajectory_update, ("continue", "wait"), "trainer.mid_trajectory_update")
    if tr.max_staleness > 0:
        _check(
            tr.placement == "split",
            "trainer.max_staleness",
            "asynchronous training needs trainer.placement=split (colocated workers generate and train in the same "
            "processes, so there is nothing to overlap)",
        )
    _one_of(tr.rollout_mode, ("batch", "streaming"), "trainer.rollout_mode")
    _one_of(tr.prefetch_log_probs, ("on", "off", "check"), "trainer.prefetch_log_probs")
    _one_of(tr.staleness_rule, ("admission", "oldest_token"), "trainer.staleness_rule")
    if tr.rollout_mode == "streaming":
        _check(
            tr.max_staleness >= 1 and tr.mid_trajectory_update == "continue",
            "trainer.rollout_mode",
            f"streaming needs trainer.max_staleness >= 1 (got {tr.max_staleness}) and "
            f"trainer.mid_trajectory_update=continue (got {tr.mid_trajectory_update}): trajectories keep generating "
            "across weight updates",
        )
    _one_of(cfg.algorithm.off_policy.mode, ("auto", *OFF_POLICY_MODES), "algorithm.off_policy.mode")
    _check(cfg.algorithm.off_policy.is_cap > 1, "algorithm.off_policy.is_cap", "must be > 1")


def _validate_health(cfg: RSearchConfig) -> None:
    brk, sup, wd = cfg.retriever.breaker, cfg.retriever.supervisor, cfg.trainer.watchdog
    _check(cfg.retriever.replicas >= 0, "retriever.replicas", "must be >= 0 (0 = one server process)")
    _check(cfg.retriever.replica_cpus > 0, "retriever.replica_cpus", "must be > 0")
    _validate_record_replay(cfg.retriever)
    fetch = cfg.retriever.fetch
    _check(fetch.timeout_s > 0, "retriever.fetch.timeout_s", "must be > 0")
    _check(fetch.max_retries >= 0, "retriever.fetch.max_retries", "must be >= 0")
    _check(fetch.max_bytes >= 1, "retriever.fetch.max_bytes", "must be >= 1")
    _check(fetch.max_redirects >= 0, "retriever.fetch.max_redirects", "must be >= 0 (0 = no redirect followed)")
    _check(fetch.page_tokens >= 1, "retriever.fetch.page_tokens", "must be >= 1")
    _check(brk.window >= 1, "retriever.breaker.window", "must be >= 1")
    _check(1 <= brk.min_calls <= brk.window, "retriever.breaker.min_calls", "must be in [1, retriever.breaker.window]")
    _check(0 < brk.failure_rate <= 1, "retriever.breaker.failure_rate", "must be in (0, 1]")
    _check(brk.deadline_s > 0, "retriever.breaker.deadline_s", "must be > 0")
    _check(brk.probe_interval_s > 0, "retriever.breaker.probe_interval_s", "must be > 0")
    _check(sup.check_interval_s > 0, "retriever.supervisor.check_interval_s", "must be > 0")
    _check(sup.health_timeout_s > 0, "retriever.supervisor.health_timeout_s", "must be > 0")
    _check(sup.unhealthy_after >= 1, "retriever.supervisor.unhealthy_after", "must be >= 1")
    _check(sup.max_restarts >= 0, "retriever.supervisor.max_restarts", "must be >= 0")
    _check(sup.backoff_s >= 0, "retriever.supervisor.backoff_s", "must be >= 0")
    _check(wd.max_rollbacks >= 0, "trainer.watchdog.max_rollbacks", "must be >= 0")
    _check(0 < wd.lr_factor <= 1, "trainer.watchdog.lr_factor", "must be in (0, 1]")
    _check(1 <= wd.min_history <= wd.history, "trainer.watchdog.min_history", "must be in [1, watchdog.history]")
    _check(wd.max_logprob_gap > 0, "trainer.watchdog.max_logprob_gap", "must be > 0")
    _check(0 <= wd.answer_collapse < 1, "trainer.watchdog.answer_collapse", "must be in [0, 1)")
    _check(0 <= wd.entropy_collapse < 1, "trainer.watchdog.entropy_collapse", "must be in [0, 1)")
    _check(wd.entropy_explode > 1, "trainer.watchdog.entropy_explode", "must be > 1")
    _check(wd.entropy_explode_min >= 0, "trainer.watchdog.entropy_explode_min", "must be >= 0 (nats a token)")
    _check(wd.length_blowup > 1, "trainer.watchdog.length_blowup", "must be > 1")


def _validate_record_replay(r: RetrieverConfig) -> None:
    _one_of(r.replay_miss, REPLAY_MISSES, "retriever.replay_miss")
    for key in ("record", "replay"):
        path = getattr(r, key)
        _check(path is None or (isinstance(path, str) and path.strip() != ""), f"retriever.{key}", "must be a path")
    _check(
        not (r.record and r.replay_only),
        "retriever.record",
        "records nothing with retriever.replay and retriever.replay_miss=error (no search reaches the retriever): "
        "set retriever.replay_miss=live to record what the replay store lacks",
    )


def _validate_lora_and_packing(cfg: RSearchConfig) -> None:
    m = cfg.model
    _check(m.lora_rank >= 0, "model.lora_rank", "must be >= 0 (0 = no LoRA)")
    if m.lora_rank > 0:
        _check(m.lora_alpha > 0, "model.lora_alpha", "must be > 0")
        _check(len(m.lora_target_modules) > 0, "model.lora_target_modules", "name at least one module")
    if m.attn_implementation is not None:
        _one_of(m.attn_implementation, ATTN_IMPLEMENTATIONS, "model.attn_implementation")
        if m.attn_implementation == "flash_attention_2":
            _check(cfg.trainer.device == "cuda", "model.attn_implementation", "flash_attention_2 needs device=cuda")
    longest = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    for role in ("actor", "critic"):
        sub = getattr(cfg, role)
        # a packed row's Gated DeltaNet layers would carry one sequence's recurrent / conv state into the next:
        # transformers' torch path ignores the boundaries (tests/workers/test_workers_hybrid.py measures it)
        _check(
            not (sub.use_remove_padding and cfg.model.family in HYBRID_FAMILIES),
            f"{role}.use_remove_padding",
            f"model.family={cfg.model.family} is a hybrid (linear-attention layers with a recurrent state): packed "
            "sequences would leak state into each other; set it false (padded micro-batches)",
        )
        if sub.use_dynamic_bsz:
            _check(
                sub.ppo_max_token_len_per_gpu >= longest,
                f"{role}.ppo_max_token_len_per_gpu",
                f"{sub.ppo_max_token_len_per_gpu} < data.max_prompt_length + rollout.max_response_length = {longest}:"
                " the longest trajectory would not fit in a micro-batch",
            )
