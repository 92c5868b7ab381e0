"""A Ray job for the multi-host harness: build the product's worker groups (rsearch_verl/workers/placement.py) with
probe workers for a CPU config with trainer.n_workers=2 trainer.nnodes=2, and report the node IP of every rank; then
ask for trainer.nnodes=3, a loopback retriever.url, a run directory on the driver's private disk, and report the
errors. Prints one JSON line. RUN_DIR: a directory every host sees (the host checks,
rsearch_verl/trainer/preflight.py `check_hosts`, look for the run directory's config.yaml on every host, as in a run).

    ray job submit --address http://HEAD:PORT --working-dir . -- python tests/cluster/placement_job.py RUN_DIR
"""

import json
import os
import shutil
import sys
import tempfile

import ray

from rsearch_verl.config import load_config
from rsearch_verl.testing.placement_probe import probe_worker_classes
from rsearch_verl.trainer.preflight import check_hosts
from rsearch_verl.workers.placement import build_worker_groups
from rsearch_verl.workers.pools import PlacementError

# batch sizes that divide 1..3 workers
BASE = ["+recipe=search_r1_ppo", "trainer.placement_timeout_s=30", "data.train_batch_size=6"]
BASE += ["actor.ppo_mini_batch_size=6", "critic.ppo_mini_batch_size=6", "actor.micro_batch_size=1"]
BASE += ["critic.micro_batch_size=1"]


def error_of(*overrides: str) -> str | None:
    cfg = load_config([*BASE, *overrides])
    try:
        check_hosts(cfg)  # as the training session does, before the worker groups
        build_worker_groups(cfg, probe_worker_classes())
    except PlacementError as exc:
        return str(exc)
    return None


def main(run_dir: str) -> dict:
    BASE.append(f"trainer.run_dir={run_dir}")
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write("{}\n")  # stands in for the run's config (rsearch_verl/trainer/session.py writes it)
    ray.init()
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    cfg = load_config([*BASE, "trainer.n_workers=2", "trainer.nnodes=2"])
    check_hosts(cfg)
    groups = build_worker_groups(cfg, probe_worker_classes())
    ranks = [{"rank": w["rank"], "ip": ips[w["node"]]} for w in groups.actor.where()]
    errors = {
        "nnodes3": error_of("trainer.n_workers=3", "trainer.nnodes=3"),
        "loopback_url": error_of("trainer.n_workers=2", "trainer.nnodes=2", "retriever.url=http://127.0.0.1:8000"),
    }
    private = tempfile.mkdtemp(dir="/tmp")  # the driver's /tmp: no worker host sees it
    with open(os.path.join(private, "config.yaml"), "w") as f:
        f.write("{}\n")
    errors["private_run_dir"] = error_of("trainer.n_workers=2", "trainer.nnodes=2", f"trainer.run_dir={private}")
    shutil.rmtree(private)
    return {"ranks": ranks, "errors": errors}


if __name__ == "__main__":
    # the job's stdout is what `ray job submit` relays: the test reads this line
    sys.stdout.write("PLACEMENT " + json.dumps(main(sys.argv[1])) + "\n")
