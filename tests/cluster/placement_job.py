"""A Ray job for the multi-host harness: build the product's worker groups (rsearch_verl/workers/placement.py) with
probe workers for a CPU config with trainer.n_workers=2 trainer.nnodes=2, and report the node IP of every rank; then
ask for trainer.nnodes=3 and report the error. Prints one JSON line.

    ray job submit --address http://HEAD:PORT --working-dir . -- python tests/cluster/placement_job.py
"""

import json
import sys

import ray

from rsearch_verl.config import load_config
from rsearch_verl.testing.placement_probe import probe_worker_classes
from rsearch_verl.workers.placement import PlacementError, build_worker_groups

# batch sizes that divide 1..3 workers
BASE = ["+recipe=search_r1_ppo", "trainer.placement_timeout_s=30", "data.train_batch_size=6"]
BASE += ["actor.ppo_mini_batch_size=6", "critic.ppo_mini_batch_size=6", "actor.micro_batch_size=1"]
BASE += ["critic.micro_batch_size=1"]


def main() -> dict:
    ray.init()
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    cfg = load_config([*BASE, "trainer.n_workers=2", "trainer.nnodes=2"])
    groups = build_worker_groups(cfg, probe_worker_classes())
    ranks = [{"rank": w["rank"], "ip": ips[w["node"]]} for w in groups.actor.where()]
    too_many = load_config([*BASE, "trainer.n_workers=3", "trainer.nnodes=3"])
    try:
        build_worker_groups(too_many, probe_worker_classes())
        error = None
    except PlacementError as exc:
        error = str(exc)
    return {"ranks": ranks, "nnodes3_error": error}


if __name__ == "__main__":
    # the job's stdout is what `ray job submit` relays: the test reads this line
    sys.stdout.write("PLACEMENT " + json.dumps(main()) + "\n")
