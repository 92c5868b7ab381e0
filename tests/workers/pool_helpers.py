"""One resource pool of a config, for tests that start a single worker group at a time (the product builds all of a
config's pools at once: rsearch_verl/workers/pools.py `build_pools`).

    from pool_helpers import one_pool                          # tests/workers/pool_helpers.py
    group = start_group(one_pool(cfg, "fsdp"), ActorWorker, cfg, "fsdp", with_rollout=False)
"""

from __future__ import annotations

import time

from verl.single_controller.ray import RayResourcePool

from rsearch_verl.config import RSearchConfig
from rsearch_verl.workers.pools import alive_nodes, assign_nodes, create_pool, node_pins, pool_specs


def one_pool(cfg: RSearchConfig, name: str, role: str = "actor") -> RayResourcePool:
    """The config's pool for `role`, named `name`, checked against the cluster and created within
    trainer.placement_timeout_s."""
    spec = pool_specs(cfg)[role]
    nodes = alive_nodes()
    placed = assign_nodes([spec], nodes)
    return create_pool(spec, time.monotonic() + cfg.trainer.placement_timeout_s, name, node_pins(spec, placed, nodes))
