"""Driver-side phases of a training step that are plain functions of the batch: rollout statistics, the loss mask,
rewards, log-prob checks, importance weights, KL-in-reward, advantages; and validation metrics. The workers do the heavy
tensor work; these run in the single controller.

One convention (`Trainer.train_step` in trainer/loop.py reads as a list of them, one line each):

    batch, metrics = phase(batch, *inputs)

A phase takes the step's DataProto (keys documented in rsearch_verl/batch.py) and returns the batch (a new DataProto
or the same one with the keys it writes) and its own namespaced metrics; it never writes into a dict it was given, and
every batch key it changes (uid included) is one it documents writing. The other functions here are the phases' pure
helpers: they read a batch and return values (masks, metrics, new uids), writing into none of their arguments.
"""

from __future__ import annotations

import numpy as np
import torch
from verl import DataProto

from rsearch_verl import batch as batch_keys
from rsearch_verl import signals as sig
from rsearch_verl.algos.advantages import compute_advantage, scores_to_token_rewards
from rsearch_verl.algos.kl import apply_kl_penalty, kl_coef_at
from rsearch_verl.algos.off_policy import importance_weights
from rsearch_verl.batch import FINISH_REASONS
from rsearch_verl.config import RSearchConfig
from rsearch_verl.rewards import RewardInput, compute_rewards
from rsearch_verl.rewards.qa import exact_match, f1_score
from rsearch_verl.rollout.protocols import SearchProtocol
from rsearch_verl.rollout.round_trip import check_batch_records


def reward_inputs(batch: DataProto, rows: np.ndarray | None = None) -> list[RewardInput]:
    """The reward function's input of each row in `rows` (default: every row)."""
    nt = batch.non_tensor_batch
    items = []
    for i in range(len(batch)) if rows is None else rows:
        items.append(
            RewardInput(
                response=str(nt["response_text"][i]),
                segments=[tuple(s) for s in nt["segments"][i]],
                ground_truth=list(nt["ground_truth"][i]),
                question=str(nt["question"][i]),
                data_source=str(nt["data_source"][i]),
                extra={"n_searches": int(nt["n_searches"][i]), **dict(nt["extra_info"][i] or {})},
            )
        )
    return items


def reward_phase(batch: DataProto, cfg: RSearchConfig, protocol: SearchProtocol) -> tuple[DataProto, dict[str, float]]:
    """Score every trajectory with the recipe's reward; put the score on its last policy token. The reward reads
    answers with the run's `protocol` (rollout.protocol: the one the rollout used, built once by the driver).
    A trajectory of several rows (its context folded) is scored once, and every row gets its score on its own last
    policy token: the rows share the trajectory's outcome."""
    nt = batch.non_tensor_batch
    last, owner = np.flatnonzero(batch_keys.last_rows(nt)), batch_keys.rows_of_trajectories(nt)
    items, judge = reward_inputs(batch, last), cfg.reward.judge
    per_traj = compute_rewards(cfg.reward.name, items, judge_cfg=judge, protocol=protocol, **cfg.reward.kwargs)
    results = [per_traj[k] for k in owner]
    scores = torch.tensor([r.score for r in results], dtype=torch.float32)
    batch.batch["token_level_scores"] = scores_to_token_rewards(scores, batch.batch["response_mask"])
    batch.non_tensor_batch["reward"] = np.array([r.score for r in results], dtype=object)
    batch.non_tensor_batch["answer"] = np.array([r.answer for r in results], dtype=object)
    traj_scores = torch.tensor([r.score for r in per_traj], dtype=torch.float32)
    metrics = {
        sig.REWARD: float(traj_scores.mean()),
        "reward/max": float(traj_scores.max()),
        "reward/min": float(traj_scores.min()),
    }
    keys = sorted({k for r in per_traj for k in r.metrics})
    for key in keys:
        metrics[f"reward/{key}_mean"] = float(np.mean([r.metrics.get(key, 0.0) for r in per_traj]))
    return batch, metrics


def advantage_phase(batch: DataProto, cfg: RSearchConfig, step: int) -> tuple[DataProto, dict[str, float]]:
    """KL penalty in the reward (when enabled, β from its schedule), then the recipe's advantage estimator. A folded
    trajectory's advantages are those of its rows unfolded into one sequence: the outcome once, every row's KL."""
    metrics: dict[str, float] = {}
    tensors = batch.batch
    loss_mask = tensors["loss_mask"]
    if cfg.algorithm.use_kl_in_reward:
        beta = current_kl_coef(cfg, step)
        rewards, kl_metrics = apply_kl_penalty(
            tensors["token_level_scores"],
            tensors["old_log_probs"],
            tensors["ref_log_prob"],
            loss_mask,
            beta=beta,
            kind=cfg.algorithm.kl_penalty,
        )
        tensors["token_level_rewards"] = rewards
        metrics.update(kl_metrics)
        metrics["actor/kl_coef"] = beta
    else:
        tensors["token_level_rewards"] = tensors["token_level_scores"]
    last = batch_keys.last_rows(batch.non_tensor_batch)
    # a folded trajectory's rows are one sequence: its outcome counts once (last row), its KL penalty on every row
    once = tensors["token_level_rewards"] - tensors["token_level_scores"] * torch.as_tensor(~last).unsqueeze(-1)
    advantages, returns = compute_advantage(
        cfg.algorithm.adv_estimator,
        token_level_rewards=once,
        response_mask=loss_mask,
        index=batch.non_tensor_batch["uid"],
        values=tensors["values"] if cfg.use_critic else None,
        gamma=cfg.algorithm.gamma,
        lam=cfg.algorithm.lam,
        norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
        # folded trajectories: the estimator runs on them unfolded (rows laid end to end)
        trajectory=batch_keys.rows_of_trajectories(batch.non_tensor_batch),
        last=last,
    )
    tensors["advantages"], tensors["returns"] = advantages, returns
    valid = loss_mask.bool()
    metrics["critic/advantages_mean"] = float(advantages[valid].mean()) if valid.any() else 0.0
    metrics["critic/returns_mean"] = float(returns[valid].mean()) if valid.any() else 0.0
    return batch, metrics


def fit_rows(batch: DataProto, cfg: RSearchConfig) -> tuple[DataProto, dict[str, float]]:
    """Fit a batch of folded trajectories (more rows than trajectories, rollout/context.py) to the workers: pad the rows
    to a multiple of the workers x each update's mini-batches with copies of rows that have no loss (loss_mask 0, not
    a last row), and set `meta_info["mini_batches"]` (role -> optimizer steps per epoch: trajectories / the role's
    ppo_mini_batch_size, as without folds). A batch without folds is returned as it is."""
    last = batch_keys.last_rows(batch.non_tensor_batch)
    n_traj, n_rows = int(last.sum()), len(last)
    if n_rows == n_traj:
        return batch, {}
    steps = {"actor": max(1, n_traj // cfg.actor.ppo_mini_batch_size)}
    if cfg.use_critic:
        steps["critic"] = max(1, n_traj // cfg.critic.ppo_mini_batch_size)
    divisor = cfg.world_size * int(np.lcm.reduce(list(steps.values())))
    pad = -n_rows % divisor
    if pad:
        copies = batch.select_idxs(np.arange(pad) % n_rows)
        copies.batch["loss_mask"] = torch.zeros_like(copies.batch["loss_mask"])
        copies.non_tensor_batch["last_segment"] = np.array([False] * pad, dtype=object)
        batch = DataProto.concat([batch, copies])
    batch.meta_info["mini_batches"] = steps
    return batch, {"rollout/update_rows": float(len(batch)), "rollout/padding_rows": float(pad)}


def current_kl_coef(cfg: RSearchConfig, step: int) -> float:
    algo = cfg.algorithm
    return kl_coef_at(
        step, cfg.trainer.total_steps, start=algo.kl_coef, end=algo.kl_coef_end, schedule=algo.kl_schedule
    )


def rollout_metrics(batch: DataProto) -> dict[str, float]:
    """The per-trajectory statistics of a rollout (`rollout/*`), computed once, here, on the whole batch the step
    trains on (the rollout workers report only timing and search counters: agent_loop.search_metrics). Trajectory
    statistics read each trajectory's last row; `rollout/response_len_mean` and `policy_tokens_mean` are per row."""
    nt, mask = batch.non_tensor_batch, batch.batch["response_mask"]
    resp_len = batch.batch["responses"].shape[1]
    lengths = batch.batch["attention_mask"][:, -resp_len:].sum(-1).float()
    last = batch_keys.last_rows(nt)
    searches = nt["n_searches"][last].astype(float)
    turns = nt["n_turns"][last].astype(float)
    out = {
        "rollout/searches_mean": float(np.mean(searches)),
        "rollout/searches_max": float(np.max(searches)),
        "rollout/turns_mean": float(np.mean(turns)),
        "rollout/turns_p50": float(np.percentile(turns, 50)),
        "rollout/turns_p90": float(np.percentile(turns, 90)),
        "rollout/turns_max": float(np.max(turns)),
        sig.RESPONSE_LEN: float(lengths.mean()),
        "rollout/policy_tokens_mean": float(mask.sum(-1).float().mean()),
        "rollout/rows_per_trajectory": float(len(last) / max(1, int(last.sum()))),
        "rollout/trajectories": float(last.sum()),
    }
    for reason in FINISH_REASONS:
        out[f"rollout/finish_{reason}"] = float(np.mean([r == reason for r in nt["finish_reason"][last]]))
    out.update(context_metrics(nt, last))
    if "n_opens" in nt:  # the open tool (rollout.tools); 0 in runs without it
        out["rollout/opens_mean"] = float(np.mean(nt["n_opens"][last].astype(float)))
        out["rollout/pages_read_mean"] = float(np.mean(nt["n_pages_read"][last].astype(float)))
    return out


def context_metrics(nt, last: np.ndarray) -> dict[str, float]:
    """Context statistics per trajectory (rollout/context.py): context tokens at each generation (mean of the
    trajectories' means, max), folds, trajectories ended by the context budget, tokens processed (prefill + decode,
    without a prefix cache)."""
    if "context_stats" not in nt:
        return {}
    stats = list(nt["context_stats"][last])
    col = {key: np.array([s[key] for s in stats], dtype=float) for key in stats[0]}
    return {
        "rollout/context_tokens_mean": float(col["context_tokens_mean"].mean()),
        "rollout/context_tokens_max": float(col["context_tokens_max"].max()),
        "rollout/folds_mean": float(col["folds"].mean()),
        "rollout/folds_max": float(col["folds"].max()),
        "rollout/ended_by_context": float(sum(r == "context" for r in nt["finish_reason"][last])),
        "rollout/tokens_processed_mean": float(col["tokens_processed"].mean()),
        "rollout/prefill_tokens_mean": float(col["prefill_tokens"].mean()),
    }


def validation_metrics(batch: DataProto) -> dict[str, float]:
    """EM / F1 of the extracted answer against the golds, overall and per data source; reward and searches (overall
    and per data source: a 2-hop question needs two). One entry per trajectory (its last row)."""
    nt = batch.non_tensor_batch
    last = batch_keys.last_rows(nt)
    keys = ("answer", "ground_truth", "n_searches", "reward", "data_source", "n_opens")
    nt = {key: nt[key][last] for key in keys if key in nt}
    answers = [a or "" for a in nt["answer"]]
    em = np.array([exact_match(a, list(g)) for a, g in zip(answers, nt["ground_truth"], strict=True)], dtype=float)
    f1 = np.array([f1_score(a, list(g)) for a, g in zip(answers, nt["ground_truth"], strict=True)], dtype=float)
    searches = nt["n_searches"].astype(float)
    metrics = {
        "val/em": float(em.mean()),
        "val/f1": float(f1.mean()),
        "val/reward": float(np.mean(nt["reward"].astype(float))),
        "val/searches_mean": float(np.mean(searches)),
    }
    if "n_opens" in nt:
        metrics["val/opens_mean"] = float(np.mean(nt["n_opens"].astype(float)))
    sources = nt["data_source"]
    for source in sorted(set(sources)):
        sel = sources == source
        metrics[f"val/{source}/em"] = float(em[sel].mean())
        metrics[f"val/{source}/searches_mean"] = float(searches[sel].mean())
    return metrics


def rollout_logprob_gap(batch: DataProto, version: int) -> dict[str, float]:
    """Mean |rollout engine log-prob - actor log-prob| on the tokens sampled by the actor's current weights
    (`version`; all of them when training is synchronous): ~0 when the weight sync works (both are taken at the
    rollout temperature; top_p < 1 / top_k filtering is the engine's alone and widens the gap). Tokens from older
    versions differ because the policy moved: their gap is the off-policy correction's business."""
    mask = batch.batch["response_mask"].bool() & (batch.batch["rollout_versions"] == version)
    if not mask.any():
        return {}
    gap = (batch.batch["rollout_log_probs"] - batch.batch["old_log_probs"]).abs()[mask]
    return {sig.LOGPROB_GAP: float(gap.mean()), "rollout/logprob_abs_diff_max": float(gap.max())}


def off_policy_phase(batch: DataProto, cfg: RSearchConfig) -> tuple[DataProto, dict[str, float]]:
    """Writes `is_weights`: importance weights pi_prox / pi_behav on every loss token (algorithm.off_policy), when a
    correction is on; nothing otherwise (the synchronous loop)."""
    mode = cfg.off_policy_mode
    if mode == "none":
        return batch, {}
    t = batch.batch
    weights, metrics = importance_weights(
        t["old_log_probs"], t["rollout_log_probs"], t["loss_mask"], mode, cfg.algorithm.off_policy.is_cap
    )
    t["is_weights"] = weights
    return batch, metrics


def round_trip_phase(batch: DataProto) -> tuple[DataProto, dict[str, float]]:
    """Writes nothing: the rows the rollout's round-trip check sampled carry the engine's record of what it was handed
    and what it sampled (rsearch_verl/rollout/round_trip.py); they are checked again here, on the tensors the update
    reads, after every join, trim and padding since the rollout (raises RoundTripError). Nothing without the check."""
    rows, tokens = check_batch_records(batch)
    return batch, ({"round_trip/update_rows": float(rows), "round_trip/update_tokens": float(tokens)} if rows else {})


def logprob_check_phase(batch: DataProto, step: int) -> tuple[DataProto, dict[str, float]]:
    """Writes nothing: the weight sync's log-prob gap and the sampled policy's entropy estimate, from the old log-probs
    of step `step` (the actor holds the weights of version step-1)."""
    return batch, {**rollout_logprob_gap(batch, step - 1), **sampled_entropy(batch, step - 1)}


def sampled_entropy(batch: DataProto, version: int) -> dict[str, float]:
    """Mean -log p (rollout temperature) of the sampled policy tokens under the policy that sampled them: a Monte-Carlo
    estimate of the sampling policy's per-token entropy at no extra cost (the health watchdog's entropy when the actor
    computes none). Tokens of the actor's current weights (`version`; all of them when training is synchronous) are
    scored by the actor, older ones (asynchronous training) by the rollout engine that sampled them: the newer actor's
    -log p of another policy's samples is a cross-entropy, H(old) + KL(old || new), inflated by every update."""
    t = batch.batch
    mask = t["response_mask"].bool()
    if not mask.any():
        return {}
    logp = torch.where(t["rollout_versions"] < version, t["rollout_log_probs"], t["old_log_probs"])
    return {sig.ENTROPY_MC: float(-logp[mask].mean())}


def failed_search_rows(batch: DataProto, cfg: RSearchConfig) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The trajectories to drop because a search failed for an outage reason ([B] bool; the rollout marked them
    `search_failed`; retriever.breaker.drop_failed; None when no row is marked either way), and the metrics
    `rollout/search_failed`, `rollout/dropped_trajectories`."""
    nt = batch.non_tensor_batch
    if "search_failed" not in nt:
        return None, {}
    failed = torch.tensor([bool(x) for x in nt["search_failed"]], dtype=torch.bool)
    drop = failed if cfg.retriever.breaker.drop_failed else torch.zeros_like(failed)
    return drop, {"rollout/search_failed": float(failed.sum()), sig.DROPPED: float(drop.sum())}


def age_bounded(cfg: RSearchConfig) -> bool:
    """Whether the rollout bounds the age of what a step trains (all but streaming's `admission` rule)."""
    return not (cfg.trainer.rollout_mode == "streaming" and cfg.trainer.staleness_rule == "admission")


def stale_rows(batch: DataProto, step: int, max_staleness: int, bounded: bool = True):
    """Trajectories older than the staleness bound ([B] bool), and the `async/*` metrics.

    A trajectory's staleness is how many updates its oldest policy token is behind the weights step `step` trains
    (version step-1). A pipeline that bounds the age of what it trains (batch mode; streaming with
    trainer.staleness_rule=oldest_token) never hands out a batch beyond the bound, so the drop is a guard that should
    stay 0 (`async/dropped_stale`); streaming's `admission` rule bounds where a group starts, not its age
    (`bounded` False: nothing is dropped, the off-policy correction weights the old tokens). Partial rows:
    trajectories whose tokens came from more than one version."""
    versions, mask = batch.batch["rollout_versions"], batch.batch["response_mask"].bool()
    big = torch.iinfo(versions.dtype).max
    oldest = torch.where(mask, versions, torch.full_like(versions, big)).min(-1).values
    newest = torch.where(mask, versions, torch.full_like(versions, -1)).max(-1).values
    has_tokens = mask.any(-1)
    staleness = torch.where(has_tokens, (step - 1) - oldest, torch.zeros_like(oldest))
    stale = staleness > max_staleness if bounded else torch.zeros_like(has_tokens)
    metrics = {"async/staleness_max": float(staleness.max()), "async/staleness_mean": float(staleness.float().mean())}
    for k in range(max_staleness + 1):
        metrics[f"async/staleness_{k}_frac"] = float((staleness == k).float().mean())
    metrics["async/partial_rows_frac"] = float(((newest != oldest) & has_tokens).float().mean())
    metrics["async/dropped_stale"] = float(stale.sum())
    return stale, metrics


def drop_rows(uids: np.ndarray, *masks: torch.Tensor | None) -> tuple[torch.Tensor | None, np.ndarray]:
    """Union of `masks` ([B] bool): the rows dropped from the update (None when no mask is given), and the batch's
    uids with each dropped row's own (`<uid>#dropped<i>`, a copy: `uids` is not written), so a group advantage (GRPO,
    RLOO) leaves it out of its group. The caller writes both: the uids, and loss_mask rows of zeros."""
    given = [m for m in masks if m is not None]
    if not given:
        return None, uids
    drop = torch.stack(given).any(0)
    uids = uids.copy()
    for i in drop.nonzero().flatten().tolist():
        uids[i] = f"{uids[i]}#dropped{i}"
    return drop, uids


def loss_mask_phase(batch: DataProto, cfg: RSearchConfig, step: int) -> tuple[DataProto, dict[str, float]]:
    """Writes `loss_mask`, the one place that decides which tokens any loss sees (rsearch_verl/batch.py: written once,
    here, right after the rollout), and `uid` of the dropped rows: observations masked or not
    (algorithm.mask_observations), and no token of a dropped row, one whose search failed because the retriever was
    down or, never by construction, one older than the staleness bound."""
    failed, failed_metrics = failed_search_rows(batch, cfg)
    stale, stale_metrics = stale_rows(batch, step, cfg.trainer.max_staleness, age_bounded(cfg))
    dropped, uids = drop_rows(batch.non_tensor_batch["uid"], failed, stale)
    batch.non_tensor_batch["uid"] = uids  # a dropped row leaves its group
    batch.batch["loss_mask"] = batch_keys.loss_mask(batch.batch, cfg.algorithm.mask_observations, dropped)
    return batch, {**failed_metrics, **stale_metrics}


def rollout_phase(batch: DataProto) -> tuple[DataProto, dict[str, float]]:
    """Takes the rollout workers' metrics off the batch (`meta_info["metrics"]`: search counters, timing) and adds the
    per-trajectory statistics of the whole batch (`rollout_metrics`)."""
    return batch, {**batch.meta_info.pop("metrics", {}), **rollout_metrics(batch)}


def worker_args_phase(batch: DataProto, cfg: RSearchConfig, step: int) -> tuple[DataProto, dict[str, float]]:
    """Writes the meta_info the worker calls read (a DataProto carries a call's arguments across the worker boundary):
    `temperature` (every log-prob takes logits / T, as the rollout sampled), `kl_coef` (the KL loss's β at `step`) and
    `step` (which update this is, for tools on the workers' side: testing/faults.py)."""
    batch.meta_info.update(temperature=cfg.rollout.temperature, kl_coef=current_kl_coef(cfg, step), step=step)
    return batch, {}
