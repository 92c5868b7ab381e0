"""Placement of the worker groups on Ray: the `WorkerGroups` handle the training loop drives, built on the resource
pools of rsearch_verl/workers/pools.py.

Placements (`trainer.placement`):
    colocate  one pool of `world_size` bundles (one GPU each on CUDA); each process holds the FSDP actor, its reference
              copy and a rollout engine (verl's hybrid engine layout). PPO's critic is a second worker group on the
              same bundles: the pool is built with verl's `max_colocate_count=2`, so verl's `RayWorkerGroup` gives
              every worker of either group `num_gpus=0.5` and actor rank r and critic rank r share GPU r. GRPO (no
              critic) uses `max_colocate_count=1`: one whole GPU per actor process.
    split     CUDA: each node's GPUs divide into `n_gpus_per_node - rollout_gpus_per_node` for the actor (+critic,
              shared as above) and `trainer.rollout_gpus_per_node` for generation-only workers (one whole GPU each);
              e.g. 6 train + 2 generate on an 8-GPU node. CPU: a second pool of `trainer.n_workers` generation workers.

Why two worker groups on shared bundles and not verl's fused class (`create_colocated_worker_cls`): the fused class
is generated at run time (a `WorkerDict` whose methods are renamed per role), which hides the worker boundary the
training loop calls; two plain groups keep `groups.actor.update_actor` / `groups.critic.update_critic` explicit. The
cost is a second CUDA context per GPU (~0.5 GB); both groups run one at a time, so they never compete for compute.

The reference policy has no group of its own: it is the actor's frozen copy (or the actor with its LoRA adapters
off), so `groups.actor.compute_ref_log_prob` computes it. The split weight sync is rsearch_verl/workers/weight_sync.py;
the multi-host checks run before this, in rsearch_verl/trainer/preflight.py (`check_hosts`).

Usage (rsearch_verl/trainer/session.py):
    groups = build_worker_groups(cfg)          # PlacementError within trainer.placement_timeout_s if it cannot fit
    out = groups.rollout.generate_sequences(prompts)
    pending = groups.rollout.submit(prompts); ...; out = pending.result()    # split: generation runs meanwhile
    groups.actor.update_actor(batch); groups.sync_rollout_weights(version=step)   # -> {"sync/bytes": ...}
"""

from __future__ import annotations

import dataclasses
import logging
import os

import ray
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

from rsearch_verl.config import RSearchConfig, to_dict
from rsearch_verl.secrets import worker_secrets
from rsearch_verl.workers.generation_group import GenerationGroup
from rsearch_verl.workers.pools import alive_nodes, build_pools, pool_specs
from rsearch_verl.workers.weight_sync import push_weights

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkerGroups:
    actor: RayWorkerGroup  # FSDP policy (+ its frozen reference copy, + rollout engine when colocated)
    critic: RayWorkerGroup | None
    rollout: GenerationGroup
    split_rollout: RayWorkerGroup | None = None

    def sync_rollout_weights(self, version: int | None = None) -> dict[str, float]:
        """Push the actor's freshly updated weights into every rollout engine, as policy `version` (the actor's
        step); returns {"sync/bytes": bytes put in the object store}. Colocated: each rank feeds its own engine
        (0 bytes leave a process). Split: rank 0 puts one copy, every rollout worker reads it; a worker that is
        generating takes it between two decode steps (or after its batch: trainer.mid_trajectory_update)."""
        if self.split_rollout is None:
            self.actor.sync_rollout_weights(version)
            return {"sync/bytes": 0.0}
        return {"sync/bytes": float(push_weights(self.actor, self.rollout, version))}

    def rollout_idle_seconds(self) -> float | None:
        """Split placement: the rollout workers' mean idle seconds since start-up (None when colocated)."""
        if self.split_rollout is None:
            return None
        return self.rollout.idle_seconds()


def start_group(
    pool: RayResourcePool, cls, cfg: RSearchConfig, name: str, threads: int = 1, **kwargs
) -> RayWorkerGroup:
    """One worker group of `cls` on `pool`, named `name`, its models initialised (blocks until ready); `kwargs` go
    to the worker's constructor."""

    ray_cls = RayClassWithInitArgs(cls=ray.remote(cls), cfg_dict=to_dict(cfg), **kwargs)
    if threads > 1:  # a threaded actor: weights and idle queries are served while a batch generates
        ray_cls.update_options({"max_concurrency": threads})
    # per-actor env vars (verl's worker_env; Ray merges them into the job's runtime env): the retrieval server's
    # token reaches the workers on every host this way, and never through the config
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=ray_cls, name_prefix=name, worker_env=worker_env(cfg))
    group.init_model()
    return group


def worker_env(cfg: RSearchConfig) -> dict[str, str] | None:
    """The secret env vars the driver has (rsearch_verl/secrets.py), for every worker actor: among them the
    token of the retriever the driver started, which exists in no job's runtime env; and the torch threads of a CPU
    worker (`cpu_threads`). None: nothing to add."""
    return {**worker_secrets(cfg), **thread_env(cfg)} or None


def thread_env(cfg: RSearchConfig, node_cpus: int | None = None, environ: dict | None = None) -> dict[str, str]:
    """OMP_NUM_THREADS / MKL_NUM_THREADS for every CPU worker from `trainer.cpu_threads` (empty: Ray's default,
    which gives an actor that asks for no CPU one thread). `auto`: the smallest alive node's CPUs (`node_cpus`)
    over the worker processes that compute at once on a node, at most the driver's own OMP_NUM_THREADS."""
    tr = cfg.trainer
    if tr.device == "cuda" or str(tr.cpu_threads) == "ray":
        return {}
    if str(tr.cpu_threads) != "auto":
        threads = int(tr.cpu_threads)
    else:
        if node_cpus is None:
            node_cpus = int(min(n.get("CPU", 1) for n in alive_nodes()))
        busy = sum(spec.per_node[0] for spec in pool_specs(cfg).values())  # actor ranks (+ rollout workers) a node
        threads = max(1, node_cpus // busy)
        limit = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "")
        if limit.isdigit() and int(limit) >= 1:
            threads = min(threads, int(limit))
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


@dataclasses.dataclass(frozen=True)
class WorkerClasses:
    """The worker classes placed on the pools (tests pass subclasses that skip CUDA initialisation)."""

    actor: type
    critic: type
    rollout: type


def default_worker_classes() -> WorkerClasses:
    # heavy: the worker modules (models, pandas and more) load only when groups are built
    from rsearch_verl.workers.actor import ActorWorker
    from rsearch_verl.workers.critic import CriticWorker
    from rsearch_verl.workers.generation import GenerationWorker

    return WorkerClasses(ActorWorker, CriticWorker, GenerationWorker)


def build_worker_groups(cfg: RSearchConfig, classes: WorkerClasses | None = None) -> WorkerGroups:
    """Start every worker group the config needs and initialise their models (blocks until ready). Raises
    PlacementError within trainer.placement_timeout_s when the cluster cannot hold them."""
    classes = classes or default_worker_classes()
    split = cfg.trainer.placement == "split"
    pools = build_pools(cfg)
    actor = start_group(pools["actor"], classes.actor, cfg, "actor", with_rollout=not split)
    critic = start_group(pools["actor"], classes.critic, cfg, "critic") if cfg.use_critic else None
    split_rollout = start_group(pools["rollout"], classes.rollout, cfg, "rollout", threads=8) if split else None
    gen = split_rollout or actor
    groups = WorkerGroups(actor, critic, GenerationGroup(gen, gen.world_size, cfg), split_rollout)
    logger.info(
        "worker groups (%s): %s%s",
        cfg.trainer.device,
        "; ".join(spec.describe() for spec in pool_specs(cfg).values()),
        "; critic on the actor's bundles" if critic else "",
    )
    if split:
        groups.sync_rollout_weights(version=0)  # the rollout workers start from the actor's (e.g. SFT) weights
    return groups
