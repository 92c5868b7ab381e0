"""Placement of the worker groups on Ray: resource pools (placement groups) sized from the config, a check that the
cluster can hold them, and the `WorkerGroups` handle the training loop drives.

Placements (`trainer.placement`):
    colocate  one pool of `world_size` bundles (one GPU each on CUDA); each process holds the FSDP actor, its reference
              copy and a rollout engine (verl's hybrid engine layout). PPO's critic is a second worker group on the
              same bundles: the pool is built with verl's `max_colocate_count=2`, so verl's `RayWorkerGroup` gives
              every worker of either group `num_gpus=0.5` and actor rank r and critic rank r share GPU r. GRPO (no
              critic) uses `max_colocate_count=1`: one whole GPU per actor process.
    split     CUDA: each node's GPUs divide into `n_gpus_per_node - rollout_gpus_per_node` for the actor (+critic,
              shared as above) and `trainer.rollout_gpus_per_node` for rollout-only workers (one whole GPU each);
              e.g. 6 train + 2 generate on an 8-GPU node. CPU: a second pool of `trainer.n_workers` rollout workers.

Why two worker groups on shared bundles and not verl's fused class (`create_colocated_worker_cls`): the fused class
is generated at run time (a `WorkerDict` whose methods are renamed per role), which hides the worker boundary the
training loop calls; two plain groups keep `groups.actor.update_actor` / `groups.critic.update_critic` explicit. The
cost is a second CUDA context per GPU (~0.5 GB); both groups run one at a time, so they never compete for compute.

Fail fast: before any worker starts, `check_cluster` fits every pool's placement groups (one per node, STRICT_PACK,
verl's bundle shape `{"CPU": max_colocate_count, "GPU": 1}`; a pool's groups on distinct nodes, each pinned to the
node chosen for it through the node's `node:<ip>` resource) into the alive nodes' resources, and raises
`PlacementError` naming the config keys and what the cluster has. Then we create the placement groups ourselves and
wait at most `trainer.placement_timeout_s` (default 60) for them — verl's `RayResourcePool.get_placement_groups`
would wait with `ray.get(pg.ready())` and no timeout, hanging silently on a busy cluster — and hand them to verl
through the pool's `pgs` (verl returns the cached groups, as its own `merge_resource_pool` does).

Weight sync, split placement: every actor rank takes part in the FSDP all-gather, but only rank 0 returns anything:
it `ray.put`s the state dict itself and returns a small `WeightsRef`, which the driver hands to every rollout worker,
so one copy enters the object store and none passes through the driver (`sync/bytes` = one copy of the parameters;
before, world_size copies came back to the driver and one more was put). On GPUs a broadcast would skip the object
store: verl's `checkpoint_engine/nccl_checkpoint_engine.py` joins actor rank 0 (optionally more senders, as relays)
and the rollout workers in one NCCL group (ray.util.collective) and streams the weights in fixed-size buckets through
two GPU buffers (2 x bucket_size of device memory; bucket metadata over ZeroMQ), filling the next bucket while the
previous one is broadcast: no CPU copy, no whole-model buffer, GPU-to-GPU bandwidth.

World size: `RSearchConfig.world_size` (the training ranks). CPU pools follow `trainer.nnodes` as GPU pools do:
`trainer.n_workers / trainer.nnodes` bundles on each of `trainer.nnodes` nodes. CPU pools keep `max_colocate_count=1`
(verl's default of 10 asks for 10 CPUs per bundle and would hang a 2-core Ray); the CPU workers ask for no CPU of their
own, so the critic shares the actor's bundles there.

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
import time

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

    def sync_rollout_weights(self, version: int | None = None) -> dict[str, float]:
        """Push the actor's freshly updated weights into every rollout engine, as policy `version` (the actor's
        step); returns {"sync/bytes": bytes put in the object store}. Colocated: each rank feeds its own engine
        (0 bytes leave a process). Split: rank 0 puts one copy, every rollout worker reads it; a worker that is
        generating takes it between two decode steps (or after its batch: trainer.mid_trajectory_update)."""
        if self.split_rollout is None:
            self.actor.sync_rollout_weights(version)
            return {"sync/bytes": 0.0}
        handles = [h for h in self.actor.full_state_dict(as_ref=True) if h is not None]
        if len(handles) != 1:
            raise RuntimeError(f"weight sync: expected rank 0's weights only, got {len(handles)} copies")
        weights = handles[0]
        self.split_rollout.load_weights(weights.ref, version)  # a top-level ObjectRef: Ray resolves it per worker
        logger.info(
            "weight sync v%s: %d tensors, %.1f MB, one object-store copy for %d rollout workers",
            version,
            weights.n_tensors,
            weights.nbytes / 2**20,
            self.split_rollout.world_size,
        )
        return {"sync/bytes": float(weights.nbytes)}

    def rollout_idle_seconds(self) -> float | None:
        """Split placement: the rollout workers' mean idle seconds since start-up (None when colocated)."""
        if self.split_rollout is None:
            return None
        return float(np.mean(self.split_rollout.idle_seconds()))


# ---------------------------------------------------------------------------------------------------- pools


class PlacementError(RuntimeError):
    """The cluster cannot hold the worker pools the config asks for (raised before any worker starts)."""


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """One resource pool: `per_node[i]` bundles on node i, one placement group per node (STRICT_PACK)."""

    name: str
    per_node: tuple[int, ...]
    use_gpu: bool
    colocate: int  # verl's max_colocate_count: worker groups sharing each bundle; each gets 1 / colocate GPU
    sized_by: str  # the config keys (with values) that size it, for error messages

    @property
    def bundle(self) -> dict[str, float]:
        # verl's bundle shape (RayResourcePool.get_placement_groups): a CPU per colocated process, and the GPU
        return {"CPU": float(self.colocate), **({"GPU": 1.0} if self.use_gpu else {})}

    @property
    def world_size(self) -> int:
        return sum(self.per_node)

    def describe(self) -> str:
        share = f", {1 / self.colocate:g} GPU per worker" if self.use_gpu else ""
        unit = "GPU" if self.use_gpu else "worker"
        return f"{self.name}: {len(self.per_node)} node(s) x {self.per_node[0]} {unit}(s) ({self.sized_by}{share})"


def pool_specs(cfg: RSearchConfig) -> dict[str, PoolSpec]:
    """The pools the config needs: "actor" (actor+ref, +critic, +rollout engine when colocated), "rollout" (split)."""
    tr = cfg.trainer
    split = tr.placement == "split"
    if tr.device != "cuda":  # CPU workers ask for no CPU of their own: the critic fits in the actor's bundles
        # n_workers / nnodes bundles on each of nnodes nodes (config/validation.py checks that it divides)
        workers = f"trainer.n_workers={tr.n_workers} over trainer.nnodes={tr.nnodes}"
        per_node = (tr.n_workers // tr.nnodes,) * tr.nnodes
        specs = {"actor": PoolSpec("actor", per_node, False, 1, workers)}
        if split:
            specs["rollout"] = PoolSpec("rollout", per_node, False, 1, workers)
        return specs
    # the critic is a second group on the actor's bundles: two groups per GPU, half a GPU per worker
    colocate = 2 if cfg.use_critic else 1
    nodes, per_node = f"trainer.nnodes={tr.nnodes}", f"trainer.n_gpus_per_node={tr.n_gpus_per_node}"
    if not split:
        return {"actor": PoolSpec("actor", (tr.n_gpus_per_node,) * tr.nnodes, True, colocate, f"{nodes} x {per_node}")}
    rollout = tr.rollout_gpus_per_node
    share = f"trainer.rollout_gpus_per_node={rollout}"
    return {
        "actor": PoolSpec(
            "actor", (tr.n_gpus_per_node - rollout,) * tr.nnodes, True, colocate, f"{nodes} x ({per_node} - {share})"
        ),
        "rollout": PoolSpec("rollout", (rollout,) * tr.nnodes, True, 1, f"{nodes} x {share}"),
    }


def _alive_nodes() -> list[dict[str, float]]:
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def node_key(resources: dict[str, float]) -> str | None:
    """The node's own resource (`node:<ip>`, 1.0 on every Ray node): a bundle asking for a sliver of it can only be
    placed on that node. None for the head's extra marker or a resource dict without one (tests)."""
    keys = [k for k in resources if k.startswith("node:") and k != "node:__internal_head__"]
    return keys[0] if len(keys) == 1 else None


def check_cluster(specs: list[PoolSpec], nodes: list[dict[str, float]]) -> None:
    """Raise PlacementError unless every pool fits into `nodes` (resources per alive node); see assign_nodes."""
    assign_nodes(specs, nodes)


def assign_nodes(specs: list[PoolSpec], nodes: list[dict[str, float]]) -> dict[str, list[int]]:
    """Fit every pool's per-node placement groups into `nodes` (resources per alive node), largest first: the groups
    of one pool on distinct nodes (that is what trainer.nnodes means), groups of different pools may share a node.
    Returns {pool name: [index into `nodes` of each group]}; raises PlacementError when something does not fit."""
    free = [dict(n) for n in nodes]
    placed: dict[str, list[int]] = {s.name: [-1] * len(s.per_node) for s in specs}
    missing = []
    groups = sorted(((s, i, c) for s in specs for i, c in enumerate(s.per_node)), key=lambda sic: -sic[2])
    for spec, i, count in groups:
        need = {k: v * count for k, v in spec.bundle.items()}
        taken = placed[spec.name]
        fits = (j for j, f in enumerate(free) if j not in taken and all(f.get(k, 0.0) >= v for k, v in need.items()))
        j = next(fits, None)
        if j is None:
            missing.append(f"{spec.name} ({count} bundle(s) of {spec.bundle})")
            continue
        taken[i] = j
        for k, v in need.items():
            free[j][k] -= v
    if missing:
        raise PlacementError(
            f"the cluster cannot hold the worker pools [{'; '.join(s.describe() for s in specs)}]: no node left for "
            f"{', '.join(missing)}; the cluster has {len(nodes)} alive node(s) with GPUs "
            f"{[n.get('GPU', 0.0) for n in nodes]} and CPUs {[n.get('CPU', 0.0) for n in nodes]}. Lower "
            f"trainer.n_gpus_per_node / trainer.nnodes / trainer.rollout_gpus_per_node (CPU: trainer.nnodes / "
            f"trainer.n_workers) or give Ray more (ray start --num-gpus / --num-cpus, more nodes)"
        )
    return placed


def create_pool(
    spec: PoolSpec, deadline: float, name: str | None = None, nodes: list[str | None] | None = None
) -> RayResourcePool:
    """The pool's placement groups, created here and waited for until `deadline` (time.monotonic()), then handed to
    verl's pool (which returns them instead of creating and waiting without a timeout). PlacementError on timeout.
    `nodes[i]`: the node resource (node_key) group i is pinned to, as assign_nodes chose -- STRICT_PACK alone would
    let two groups of a pool pack onto one node that has room for both."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    name = name or spec.name
    pool = RayResourcePool(
        list(spec.per_node), use_gpu=spec.use_gpu, max_colocate_count=spec.colocate, name_prefix=name
    )
    nodes = nodes or [None] * len(spec.per_node)
    pgs = [
        placement_group([_pinned(spec.bundle, node)] * count, strategy="STRICT_PACK", name=f"{name}_pg{i}")
        for i, (count, node) in enumerate(zip(spec.per_node, nodes, strict=True))
    ]
    for pg in pgs:
        if not pg.wait(max(0.0, deadline - time.monotonic())):
            for created in pgs:
                remove_placement_group(created)
            free, total = ray.available_resources(), ray.cluster_resources()
            have = ", ".join(f"{free.get(k, 0.0):g} of {total.get(k, 0.0):g} {k}s" for k in ("GPU", "CPU"))
            raise PlacementError(
                f"{spec.describe()}: placement groups not granted within trainer.placement_timeout_s; the cluster "
                f"has {have} free (other jobs may hold the rest). Lower trainer.n_gpus_per_node / trainer.nnodes / "
                f"trainer.rollout_gpus_per_node, free them, or raise trainer.placement_timeout_s"
            )
    pool.pgs = pgs
    return pool


def _pinned(bundle: dict[str, float], node: str | None) -> dict[str, float]:
    return {**bundle, node: 0.001} if node else bundle


def _pins(spec: PoolSpec, placed: dict[str, list[int]], nodes: list[dict[str, float]]) -> list[str | None]:
    """The node resource of each of the pool's groups; pinned only when the pool spans nodes (one node: Ray picks)."""
    if len(spec.per_node) == 1:
        return [None]
    return [node_key(nodes[j]) for j in placed[spec.name]]


def build_pools(cfg: RSearchConfig) -> dict[str, RayResourcePool]:
    """Check the cluster, then create every pool within trainer.placement_timeout_s (PlacementError otherwise)."""
    specs = pool_specs(cfg)
    nodes = _alive_nodes()
    placed = assign_nodes(list(specs.values()), nodes)
    deadline = time.monotonic() + cfg.trainer.placement_timeout_s
    pools: dict[str, RayResourcePool] = {}
    try:
        for role, spec in specs.items():
            pools[role] = create_pool(spec, deadline, nodes=_pins(spec, placed, nodes))
    except PlacementError:
        release_pools(pools.values())
        raise
    return pools


def release_pools(pools) -> None:
    """Remove the pools' placement groups (the workers in them should be gone first)."""
    from ray.util.placement_group import remove_placement_group

    for pool in pools:
        for pg in pool.pgs or []:
            remove_placement_group(pg)


def _pool(cfg: RSearchConfig, name: str, role: str = "actor") -> RayResourcePool:
    """One pool of the config (`role`), named `name` (tests build groups one at a time)."""
    spec = pool_specs(cfg)[role]
    nodes = _alive_nodes()
    placed = assign_nodes([spec], nodes)
    return create_pool(spec, time.monotonic() + cfg.trainer.placement_timeout_s, name, _pins(spec, placed, nodes))


def _group(pool: RayResourcePool, cls, cfg: RSearchConfig, name: str, threads: int = 1, **kwargs) -> RayWorkerGroup:
    import ray

    ray_cls = RayClassWithInitArgs(cls=ray.remote(cls), cfg_dict=to_dict(cfg), **kwargs)
    if threads > 1:  # a threaded actor: weights and idle queries are served while a batch generates
        ray_cls.update_options({"max_concurrency": threads})
    # per-actor env vars (verl's worker_env; Ray merges them into the job's runtime env): the retrieval server's
    # token reaches the workers on every host this way, and never through the config
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=ray_cls, name_prefix=name, worker_env=worker_env(cfg))
    group.init_model()
    return group


def worker_env(cfg: RSearchConfig) -> dict[str, str] | None:
    """The secret env vars the driver has (rsearch_verl/trainer/secrets.py), for every worker actor: among them the
    token of the retriever the driver started, which exists in no job's runtime env (None: nothing to add)."""
    from rsearch_verl.trainer.secrets import worker_secrets

    return worker_secrets(cfg) or None


# ------------------------------------------------------------------------------------------------- hosts


class HostError(PlacementError):
    """A host of the cluster cannot run the workers: it does not see the run directory, a path of the config or the
    retrieval server (raised before any worker starts)."""


def _host_problems(run_dir: str | None, paths: dict[str, str], url: str | None) -> list[str]:
    """Run on a host: what the workers there would miss (an empty list when nothing)."""
    import httpx

    problems = []
    if run_dir and not os.path.isfile(os.path.join(run_dir, "config.yaml")):
        problems.append(f"trainer.run_dir={run_dir} is not visible (its config.yaml is missing)")
    problems += [f"{key}={path} does not exist" for key, path in paths.items() if not os.path.exists(path)]
    if url:
        try:
            httpx.get(f"{url}/health", timeout=5.0).raise_for_status()
        except httpx.HTTPError as exc:
            problems.append(f"retriever.url={url} does not answer GET /health ({exc!r})")
    return problems


def driver_paths(cfg: RSearchConfig) -> dict[str, str]:
    """The config's local paths the workers load (absolute, present on the driver's disk), by config key."""
    m = cfg.model
    keys = {"model.path": m.path, "model.tokenizer_path": m.tokenizer_path, "model.sft_checkpoint": m.sft_checkpoint}
    return {k: v for k, v in keys.items() if v and os.path.isabs(v) and os.path.exists(v)}


def check_hosts(cfg: RSearchConfig, timeout_s: float = 60.0) -> None:
    """On a cluster of several hosts: fail fast (HostError) unless every other host sees trainer.run_dir, the config's
    local paths and the retrieval server -- a probe task on each host, before any worker starts. A loopback
    retriever.url is an error there (on another host it is that host's own loopback). One host: nothing to check."""
    from urllib.parse import urlparse

    import ray

    here = ray.util.get_node_ip_address()
    others = [n for n in ray.nodes() if n.get("Alive") and n["NodeManagerAddress"] != here]
    if not others:
        return
    url = cfg.retriever.url
    if url and urlparse(url).hostname in ("127.0.0.1", "localhost", "::1"):
        raise HostError(
            f"retriever.url={url} is a loopback address, but the cluster has {len(others) + 1} hosts: workers on the "
            "others would reach their own loopback. Serve the retriever on an address every host can reach, or "
            "unset retriever.url to let the run start its own on this host's cluster address"
        )
    run_dir = cfg.trainer.run_dir
    if not run_dir or not os.path.isabs(run_dir):
        raise HostError(
            f"trainer.run_dir={run_dir!r}: a cluster of {len(others) + 1} hosts needs an absolute path on a "
            "filesystem every host mounts at the same path (checkpoints, published model files)"
        )
    probe = ray.remote(num_cpus=0)(_host_problems)
    ips = [n["NodeManagerAddress"] for n in others]
    pending = [probe.options(resources={f"node:{ip}": 0.001}).remote(run_dir, driver_paths(cfg), url) for ip in ips]
    problems = [
        f"host {ip}: {p}" for ip, found in zip(ips, ray.get(pending, timeout=timeout_s), strict=True) for p in found
    ]
    if problems:
        raise HostError(
            "the workers' hosts cannot run this config: "
            + "; ".join(problems)
            + ". trainer.run_dir must be on a filesystem every host shares; the retriever must be reachable from "
            "every host (see docs/cluster.md, Multi-host)"
        )


@dataclasses.dataclass(frozen=True)
class WorkerClasses:
    """The worker classes placed on the pools (tests pass subclasses that skip CUDA initialisation)."""

    actor: type
    critic: type
    rollout: type


def default_worker_classes() -> WorkerClasses:
    from rsearch_verl.workers.actor import ActorWorker
    from rsearch_verl.workers.critic import CriticWorker
    from rsearch_verl.workers.rollout import RolloutWorker

    return WorkerClasses(ActorWorker, CriticWorker, RolloutWorker)


def build_worker_groups(cfg: RSearchConfig, classes: WorkerClasses | None = None) -> WorkerGroups:
    """Start every worker group the config needs and initialise their models (blocks until ready). Raises
    PlacementError within trainer.placement_timeout_s when the cluster cannot hold them."""
    classes = classes or default_worker_classes()
    split = cfg.trainer.placement == "split"
    check_hosts(cfg)
    pools = build_pools(cfg)
    actor = _group(pools["actor"], classes.actor, cfg, "actor", with_rollout=not split)
    critic = _group(pools["actor"], classes.critic, cfg, "critic") if cfg.use_critic else None
    split_rollout = _group(pools["rollout"], classes.rollout, cfg, "rollout", threads=4) if split else None
    gen = split_rollout or actor
    groups = WorkerGroups(actor, critic, None, RolloutGroup(gen, gen.world_size, cfg), split_rollout)
    logger.info(
        "worker groups (%s): %s%s",
        cfg.trainer.device,
        "; ".join(spec.describe() for spec in pool_specs(cfg).values()),
        "; critic on the actor's bundles" if critic else "",
    )
    if split:
        groups.sync_rollout_weights(version=0)  # the rollout workers start from the actor's (e.g. SFT) weights
    return groups
