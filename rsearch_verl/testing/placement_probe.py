"""A probe worker for placement tests: placed by the product's own pools and `RayWorkerGroup`s
(`rsearch_verl.workers.placement.build_worker_groups(cfg, WorkerClasses(Probe, Probe, Probe))`), it records what Ray
gave it (`ray.get_gpu_ids()`, the GPU share, its placement group) where the real workers would initialise CUDA and
NCCL, which a machine without GPUs cannot. Used by tests/workers/test_workers_placement.py.

Why not a subclass of verl's `Worker`: a worker process that imports verl (and so torch and tensordict) spends ~4 s
of CPU on it; the placement tests start 32 workers on 2 shared cores. The class lives in
rsearch_verl/testing/probe_worker.py, which imports none of them (a Ray worker imports the module that defines its
actor class). `probe_worker_classes()`, called in the driver, puts verl's `register` mark (ONE_TO_ALL) on the probe's
methods so the worker group binds them as it binds a real worker's; the mark stays in the driver (`_DriverOnly`), so
the worker process never loads verl.
Its rank is the RANK verl's worker group sets for every worker.

Usage (driver):
    groups = build_worker_groups(cfg, probe_worker_classes())
    groups.actor.where()     # [{"rank", "gpu_ids", "gpu", "visible", "pg", "node", "omp"}, ...] one per rank
"""

from __future__ import annotations

from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch, register

from rsearch_verl.testing.probe_worker import Probe
from rsearch_verl.workers.placement import WorkerClasses

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
