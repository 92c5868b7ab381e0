"""Placement follows trainer.nnodes on CPU (rsearch_verl/workers/pools.py): n_workers / nnodes bundles per node,
a pool's groups on distinct nodes, the cluster checked before any worker starts. Pure checks, then the multi-host
harness (tests/cluster/netns_cluster.py): a 2-worker, 2-node config puts one worker on each host; a cluster too small,
a loopback retriever.url and a run directory only the driver sees are errors naming the key, before any worker starts.

    .venv/bin/python -m pytest tests/cluster/test_cluster_placement.py        # the harness test is marked slow
"""

import json

import pytest
from netns_cluster import job_logs

from rsearch_verl.config import ConfigError, load_config
from rsearch_verl.workers.pools import PlacementError, assign_nodes, node_key, pool_specs

# batch sizes that divide 1..4 workers
CPU = ["+recipe=search_r1_ppo", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4"]
CPU += ["critic.ppo_mini_batch_size=4", "actor.micro_batch_size=1", "critic.micro_batch_size=1"]


def test_cpu_pools_follow_nnodes():
    spec = pool_specs(load_config([*CPU, "trainer.n_workers=4", "trainer.nnodes=2"]))["actor"]
    assert spec.per_node == (2, 2) and spec.world_size == 4 and not spec.use_gpu
    split = pool_specs(load_config([*CPU, "trainer.n_workers=2", "trainer.nnodes=2", "trainer.placement=split"]))
    assert split["rollout"].per_node == (1, 1)
    with pytest.raises(ConfigError, match="trainer.nnodes"):
        load_config([*CPU, "trainer.n_workers=3", "trainer.nnodes=2"])


def test_assign_nodes_puts_a_pools_groups_on_distinct_nodes():
    spec = pool_specs(load_config([*CPU, "trainer.n_workers=2", "trainer.nnodes=2"]))["actor"]
    hosts = [{"CPU": 0.0, "node:198.18.0.1": 1.0}, {"CPU": 1.0, "node:198.18.0.10": 1.0}]
    hosts.append({"CPU": 1.0, "node:198.18.0.11": 1.0})
    assert sorted(assign_nodes([spec], hosts)["actor"]) == [1, 2]
    assert [node_key(h) for h in hosts] == ["node:198.18.0.1", "node:198.18.0.10", "node:198.18.0.11"]
    # one node with room for both groups is still one node: trainer.nnodes=2 asks for two
    with pytest.raises(PlacementError, match=r"trainer.nnodes.*trainer.n_workers"):
        assign_nodes([spec], [{"CPU": 8.0}])


@pytest.mark.slow
def test_two_workers_two_nodes_one_per_host(netns_cluster):
    cluster = netns_cluster
    done = cluster.submit_script("tests/cluster/placement_job.py", cluster.shared)
    assert done.returncode == 0, job_logs(cluster, done)
    line = next(x for x in done.stdout.splitlines() if x.startswith("PLACEMENT "))
    report = json.loads(line[len("PLACEMENT ") :])
    assert sorted(r["ip"] for r in report["ranks"]) == sorted([cluster.host_ip(0), cluster.host_ip(1)]), report
    errors = report["errors"]
    assert "trainer.nnodes" in errors["nnodes3"] and "3 alive node(s)" in errors["nnodes3"], report
    assert "retriever.url=http://127.0.0.1:8000 is a loopback address" in errors["loopback_url"], report
    assert "trainer.run_dir=/tmp/" in errors["private_run_dir"] and "not visible" in errors["private_run_dir"], report
