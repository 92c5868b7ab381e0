"""A probe worker for placement tests: placed by the product's own pools and `RayWorkerGroup`s
(`rsearch_verl.workers.placement.build_worker_groups(cfg, WorkerClasses(Probe, Probe, Probe))`), it records what Ray
gave it (`ray.get_gpu_ids()`, the GPU share, its placement group) where the real workers would initialise CUDA and
NCCL, which a machine without GPUs cannot. Used by tests/workers/test_workers_placement.py.

Why not a subclass of verl's `Worker`: a worker process that imports verl (and so torch and tensordict) spends ~4 s
of CPU on it; the placement tests start 32 workers on 2 shared cores. `probe_worker_classes()`, called in the driver,
puts verl's `register` mark (ONE_TO_ALL) on the probe's methods so the worker group binds them as it binds a real
worker's; the mark stays in the driver (`_DriverOnly`), so the worker process never loads verl.
Its rank is the RANK verl's worker group sets for every worker.

Usage (driver):
    groups = build_worker_groups(cfg, probe_worker_classes())
    groups.actor.where()     # [{"rank", "gpu_ids", "gpu", "visible", "pg", "node", "omp"}, ...] one per rank
"""

from __future__ import annotations

import os

import ray
from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch, register

from rsearch_verl.workers.placement import WorkerClasses
from rsearch_verl.workers.weights_ref import WeightsRef


class Probe:
    """Stands in for the actor, critic and rollout workers (same constructor arguments and the methods the driver
    calls while building the groups: init_model, and for the split weight sync full_state_dict / load_weights)."""

    def __init__(self, cfg_dict: dict, **kwargs):
        self.rank = int(os.environ["RANK"])
        self.version: int | None = None

    def init_model(self):
        pass  # the real workers set their CUDA device and join the NCCL group here

    def where(self) -> dict:
        """Rank, GPU ids, the GPU share (Ray's assigned resources), CUDA_VISIBLE_DEVICES, placement group, node, and
        the OpenMP threads its torch would use (OMP_NUM_THREADS)."""
        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
            "gpu": ctx.get_assigned_resources().get("GPU", 0.0),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "pg": ctx.get_placement_group_id(),
            "node": ctx.get_node_id(),
            "omp": os.environ.get("OMP_NUM_THREADS"),
        }

    def full_state_dict(self, as_ref: bool = False):
        """As the actor does: rank 0 puts one copy and returns its handle, the other ranks nothing."""
        if self.rank != 0:
            return None

        return WeightsRef(ray.put({"w": list(range(256))}), nbytes=256 * 8, n_tensors=1)

    def load_weights(self, state_dict: dict, version: int | None = None):
        if state_dict.get("w") != list(range(256)):  # Ray resolved the reference to rank 0's object
            raise ValueError(f"probe: got {type(state_dict)} instead of rank 0's weights")
        self.version = version

    def policy_version(self) -> int | None:
        return self.version


_METHODS = ("init_model", "where", "full_state_dict", "load_weights", "policy_version")


def probe_worker_classes():
    """`WorkerClasses` with the probe in every role, its methods marked for verl's worker groups (driver side)."""

    for name in _METHODS:
        fn = getattr(Probe, name)
        setattr(fn, MAGIC_ATTR, _DriverOnly(getattr(register(dispatch_mode=Dispatch.ONE_TO_ALL)(fn), MAGIC_ATTR)))
    return WorkerClasses(actor=Probe, critic=Probe, rollout=Probe)


class _DriverOnly(dict):
    """verl's mark (its dispatch enums) for the driver's binding. Ray's tracing wrappers copy a method's __dict__ and
    travel by value, so the mark would reach the worker and import verl there: it pickles as an empty dict instead."""

    def __reduce__(self):
        return (dict, ())
