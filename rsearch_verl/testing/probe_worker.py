"""The probe worker class of the placement tests (rsearch_verl/testing/placement_probe.py marks its methods for verl's
worker groups in the driver): it records what Ray gave it where the real workers would initialise CUDA and NCCL.

A module of its own with no heavy imports: Ray's worker process imports the module that defines an actor class, and
one that imports verl (and so torch, tensordict, transformers) costs each of the 16-32 probe processes ~5-9 s of CPU
on 2 shared cores. `where()` says which of torch and verl the process loaded (the placement tests assert none).
"""

from __future__ import annotations

import os
import sys

import ray

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
        the OpenMP threads its torch would use (OMP_NUM_THREADS), and which of torch and verl the process loaded."""
        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
            "gpu": ctx.get_assigned_resources().get("GPU", 0.0),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "pg": ctx.get_placement_group_id(),
            "node": ctx.get_node_id(),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "heavy": sorted(m for m in ("torch", "verl") if m in sys.modules),  # [] : this process stayed light
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
