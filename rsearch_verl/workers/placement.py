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
    pending = groups.rollout.submit(prompts); ...; out = pending.result()    # split: generation runs meanwhile
    groups.actor.update_actor(batch); groups.sync_rollout_weights(version=step)
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
        return self.submit(prompts).result()

    def submit(self, prompts: DataProto) -> PendingRollout:
        """Start generating and return at once when the group runs on its own (split placement); a colocated group
        generates before this returns (its processes are the actor's)."""
        validate = bool(prompts.meta_info.get("validate", False))
        n = self.cfg.rollout.val_n if validate else self.cfg.rollout.n
        padded, pad = pad_dataproto_to_divisor(prompts, self.n_workers)
        if hasattr(self.group, "generate_sequences_async"):
            return PendingRollout(self.group.generate_sequences_async(padded), pad * n)
        return PendingRollout(self.group.generate_sequences(padded), pad * n)


class PendingRollout:
    """A batch being generated: `done()` polls, `result()` waits and returns it unpadded, trimmed, metrics reduced."""

    def __init__(self, out, pad: int):
        self._out, self._pad = out, pad  # a DataProto, or verl's DataProtoFuture of the workers' chunks

    def done(self) -> bool:
        import ray

        if isinstance(self._out, DataProto):
            return True
        ready, _ = ray.wait(list(self._out.futures), num_returns=len(self._out.futures), timeout=0)
        return len(ready) == len(self._out.futures)

    def result(self) -> DataProto:
        out = self._out if isinstance(self._out, DataProto) else self._out.get()
        out = unpad_dataproto(out, self._pad)
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

    def sync_rollout_weights(self, version: int | None = None) -> None:
        """Push the actor's freshly updated weights into every rollout engine, as policy `version` (the actor's
        step). Split placement: the driver ships one copy (ray.put) to every rollout worker; a worker that is
        generating takes them between two decode steps (or after its batch: trainer.mid_trajectory_update)."""
        if self.split_rollout is None:
            self.actor.sync_rollout_weights(version)
            return
        import ray

        state = ray.put(self.actor.full_state_dict()[0])
        self.split_rollout.load_weights(state, version)

    def rollout_idle_seconds(self) -> float | None:
        """Split placement: the rollout workers' mean idle seconds since start-up (None when colocated)."""
        if self.split_rollout is None:
            return None
        return float(np.mean(self.split_rollout.idle_seconds()))


def _pool(cfg: RSearchConfig, name: str) -> RayResourcePool:
    if cfg.trainer.device == "cuda":
        counts = [cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes
        return RayResourcePool(counts, use_gpu=True, max_colocate_count=1, name_prefix=name)
    return RayResourcePool([cfg.trainer.n_workers], use_gpu=False, max_colocate_count=1, name_prefix=name)


def _group(pool: RayResourcePool, cls, cfg: RSearchConfig, name: str, threads: int = 1, **kwargs) -> RayWorkerGroup:
    import ray

    ray_cls = RayClassWithInitArgs(cls=ray.remote(cls), cfg_dict=to_dict(cfg), **kwargs)
    if threads > 1:  # a threaded actor: weights and idle queries are served while a batch generates
        ray_cls.update_options({"max_concurrency": threads})
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
    split_rollout = _group(_pool(cfg, "rollout"), RolloutWorker, cfg, "rollout", threads=4) if split else None
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
        groups.sync_rollout_weights(version=0)  # the rollout workers start from the actor's (e.g. SFT) weights
    return groups
