"""Placement of the worker groups on Ray: resource pools (placement groups) sized from the config, and the
`WorkerGroups` handle the training loop drives.

Placements (`trainer.placement`):
    colocate  one pool of `world_size` bundles; each process holds the FSDP actor, its reference copy and a rollout
              engine (verl's hybrid engine layout); the critic group, when PPO needs one, shares the same bundles.
    split     the same actor (+critic) pool, plus a second pool of rollout-only workers that get the actor's
              weights through the driver after every update.

World size: `trainer.nnodes * trainer.n_gpus_per_node` on CUDA, `trainer.n_workers` on CPU. Pools use
`max_colocate_count=1`: verl's default asks for 10 CPUs per bundle and would hang a 2-core Ray.

Usage (rsearch_verl/trainer/session.py):
    groups = build_worker_groups(cfg)
    out = groups.rollout.generate_sequences(prompts)
    groups.actor.update_actor(batch); groups.sync_rollout_weights()
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
from verl import DataProto
from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

from rsearch_verl.batch import trim_padding
from rsearch_verl.config import RSearchConfig, to_dict

logger = logging.getLogger(__name__)


def reduce_metrics(meta_info: dict) -> dict:
    """Average the per-worker metric lists that DataProto.concat collects into one float per key."""
    metrics = meta_info.get("metrics") or {}
    return {k: float(np.mean(v)) if isinstance(v, list) else float(v) for k, v in metrics.items()}


class RolloutGroup:
    """Front of whichever group generates: pads the prompts to the group size, unpads and trims the result."""

    def __init__(self, group: RayWorkerGroup, n_workers: int, cfg: RSearchConfig):
        self.group, self.n_workers, self.cfg = group, n_workers, cfg

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        validate = bool(prompts.meta_info.get("validate", False))
        n = self.cfg.rollout.val_n if validate else self.cfg.rollout.n
        padded, pad = pad_dataproto_to_divisor(prompts, self.n_workers)
        out = self.group.generate_sequences(padded)
        out = unpad_dataproto(out, pad * n)
        out.meta_info["metrics"] = reduce_metrics(out.meta_info)
        trim_padding(out.batch)
        return out


@dataclasses.dataclass
class WorkerGroups:
    actor: RayWorkerGroup  # FSDP policy (+ reference copy, + rollout engine when colocated)
    critic: RayWorkerGroup | None
    ref: RayWorkerGroup | None  # None: the reference lives in the actor processes
    rollout: RolloutGroup
    split_rollout: RayWorkerGroup | None = None

    def sync_rollout_weights(self) -> None:
        """Push the actor's freshly updated weights into every rollout engine."""
        if self.split_rollout is None:
            self.actor.sync_rollout_weights()
            return
        state = self.actor.full_state_dict()[0]
        self.split_rollout.load_weights(state)


def _pool(cfg: RSearchConfig, name: str) -> RayResourcePool:
    if cfg.trainer.device == "cuda":
        counts = [cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes
        return RayResourcePool(counts, use_gpu=True, max_colocate_count=1, name_prefix=name)
    return RayResourcePool([cfg.trainer.n_workers], use_gpu=False, max_colocate_count=1, name_prefix=name)


def _group(pool: RayResourcePool, cls, cfg: RSearchConfig, name: str, **kwargs) -> RayWorkerGroup:
    import ray

    ray_cls = RayClassWithInitArgs(cls=ray.remote(cls), cfg_dict=to_dict(cfg), **kwargs)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=ray_cls, name_prefix=name)
    group.init_model()
    return group


def build_worker_groups(cfg: RSearchConfig) -> WorkerGroups:
    """Start every worker group the config needs and initialise their models (blocks until ready)."""
    from rsearch_verl.workers.actor import ActorWorker
    from rsearch_verl.workers.critic import CriticWorker
    from rsearch_verl.workers.rollout import RolloutWorker

    split = cfg.trainer.placement == "split"
    pool = _pool(cfg, "actor")
    actor = _group(pool, ActorWorker, cfg, "actor", with_rollout=not split)
    critic = _group(pool, CriticWorker, cfg, "critic") if cfg.use_critic else None
    split_rollout = _group(_pool(cfg, "rollout"), RolloutWorker, cfg, "rollout") if split else None
    gen = split_rollout or actor
    groups = WorkerGroups(actor, critic, None, RolloutGroup(gen, cfg.world_size, cfg), split_rollout)
    logger.info(
        "worker groups: %d actor rank(s)%s%s (%s)",
        cfg.world_size,
        ", critic" if critic else "",
        ", split rollout" if split else "",
        cfg.trainer.device,
    )
    if split:
        groups.sync_rollout_weights()  # the rollout workers start from the actor's (e.g. SFT) weights
    return groups
