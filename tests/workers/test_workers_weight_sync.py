"""Split placement's weight sync moves one copy of the parameters: 2 FSDP actor ranks (gloo) and 2 rollout workers on
a local CPU Ray, the real workers and a tiny random Qwen2.

Both actor ranks take part in the gather, only rank 0 returns anything (a `WeightsRef` to the one copy it put in the
object store), and the rollout workers load that copy: `sync/bytes` == the bytes of one state dict, where the old
path returned world_size copies to the driver and put one more.

Run: .venv/bin/python -m pytest -q tests/workers/test_workers_weight_sync.py
"""

from __future__ import annotations

import logging

import pytest

from rsearch_verl.config import load_config
from rsearch_verl.workers.placement import build_worker_groups
from rsearch_verl.workers.pools import release_pools
from rsearch_verl.workers.weights_ref import WeightsRef

ray = pytest.importorskip("ray")
logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False)
    yield
    ray.shutdown()


def _state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@pytest.mark.slow
def test_split_sync_moves_one_copy(ray_cluster):
    cfg = load_config(
        ["model=tiny", "model.sft_checkpoint=null", "trainer=cpu", "trainer.n_workers=2", "trainer.placement=split",
         "data.train_batch_size=4", "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus",
         "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=1"]
    )  # fmt: skip
    groups = build_worker_groups(cfg)  # ends with the start-up sync (version 0)
    try:
        assert groups.split_rollout.policy_version() == [0, 0]
        per_rank = groups.actor.full_state_dict(as_ref=True)  # what the sync asks the actor for
        assert isinstance(per_rank[0], WeightsRef) and per_rank[1] is None
        one_copy = _state_bytes(ray.get(per_rank[0].ref))
        assert per_rank[0].nbytes == one_copy
        plain = groups.actor.full_state_dict()  # without the ref: the state dict, still from rank 0 only
        assert plain[1] is None and _state_bytes(plain[0]) == one_copy

        metrics = groups.sync_rollout_weights(version=1)
        assert metrics == {"sync/bytes": float(one_copy)}  # one copy, not world_size (+1) copies
        assert groups.split_rollout.policy_version() == [1, 1]
        before = (cfg.world_size + 1) * one_copy  # world_size returned to the driver, then one ray.put
        logger.info("bytes per sync: %d before -> %d after (%d ranks)", before, one_copy, cfg.world_size)
    finally:
        for group in (groups.actor, groups.split_rollout):
            for worker in group.workers:
                ray.kill(worker)
        release_pools({id(g.resource_pool): g.resource_pool for g in (groups.actor, groups.split_rollout)}.values())
