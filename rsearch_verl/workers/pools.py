"""Resource pools: the placement groups (bundles) the worker groups run in, sized from the config, checked against
the cluster and created with a timeout.

Pools (`pool_specs`): "actor" (actor + reference, + critic, + rollout engine when colocated) and, for
`trainer.placement=split`, "rollout". Each pool is one placement group per node (STRICT_PACK) of verl's bundle shape
`{"CPU": max_colocate_count, "GPU": 1}`; on CUDA the critic is a second worker group on the actor's bundles
(`max_colocate_count=2`: half a GPU per worker), GRPO (no critic) takes one whole GPU per actor process. CPU pools
follow `trainer.nnodes` too (`trainer.n_workers / trainer.nnodes` bundles per node) and keep `max_colocate_count=1`
(verl's default of 10 asks for 10 CPUs per bundle and would hang a 2-core Ray).

Fail fast: before any worker starts, `assign_nodes` fits every pool's placement groups into the alive nodes'
resources (a pool's groups on distinct nodes, each pinned to its node through the node's `node:<ip>` resource) and
raises `PlacementError` naming the config keys and what the cluster has. Then `create_pool` creates the placement
groups itself and waits at most `trainer.placement_timeout_s` for them -- verl's `RayResourcePool.get_placement_groups`
would wait with `ray.get(pg.ready())` and no timeout, hanging silently on a busy cluster -- and hands them to verl
through the pool's `pgs` (verl returns the cached groups, as its own `merge_resource_pool` does).

    pools = build_pools(cfg)        # {"actor": RayResourcePool, ["rollout": ...]}; PlacementError when it cannot fit
    release_pools(pools.values())   # after the workers in them are gone
"""

from __future__ import annotations

import dataclasses
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from verl.single_controller.ray import RayResourcePool

from rsearch_verl.config import RSearchConfig


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


def alive_nodes() -> list[dict[str, float]]:
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def node_key(resources: dict[str, float]) -> str | None:
    """The node's own resource (`node:<ip>`, 1.0 on every Ray node): a bundle asking for a sliver of it can only be
    placed on that node. None for the head's extra marker or a resource dict without one (tests)."""
    keys = [k for k in resources if k.startswith("node:") and k != "node:__internal_head__"]
    return keys[0] if len(keys) == 1 else None


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


def node_pins(spec: PoolSpec, placed: dict[str, list[int]], nodes: list[dict[str, float]]) -> list[str | None]:
    """The node resource of each of the pool's groups; pinned only when the pool spans nodes (one node: Ray picks)."""
    if len(spec.per_node) == 1:
        return [None]
    return [node_key(nodes[j]) for j in placed[spec.name]]


def build_pools(cfg: RSearchConfig) -> dict[str, RayResourcePool]:
    """Check the cluster, then create every pool within trainer.placement_timeout_s (PlacementError otherwise)."""
    specs = pool_specs(cfg)
    nodes = alive_nodes()
    placed = assign_nodes(list(specs.values()), nodes)
    deadline = time.monotonic() + cfg.trainer.placement_timeout_s
    pools: dict[str, RayResourcePool] = {}
    try:
        for role, spec in specs.items():
            pools[role] = create_pool(spec, deadline, nodes=node_pins(spec, placed, nodes))
    except PlacementError:
        release_pools(pools.values())
        raise
    return pools


def release_pools(pools) -> None:
    """Remove the pools' placement groups (the workers in them should be gone first)."""

    for pool in pools:
        for pg in pool.pgs or []:
            remove_placement_group(pg)
