"""The README recipe on a real multi-host cluster (tests/cluster/netns_cluster.py: a 0-CPU head where the driver
runs, two 1-CPU worker hosts with private ~/.cache and /tmp, a shared run directory), submitted with
launch/submit.sh: PPO with a critic, 2 FSDP ranks over 2 nodes, the toy world, its tokenizer and a warm start built on
the driver's disk (reduced to one cheap epoch: what matters is that the workers load what the driver built), the
run's own retrieval server on the driver. Then one host stops and the same run directory resumes on 1 rank. And GRPO
with split placement (one actor rank, one rollout worker): the two pools land on different hosts (1 CPU each), so
every weight sync crosses hosts through the object store.

    .venv/bin/python -m pytest tests/cluster/test_cluster_e2e.py -m slow      # as root (CAP_NET_ADMIN); ~4 min
"""

import glob
import json
import os
import pathlib
import sys

import pytest
import yaml
from netns_cluster import ROOT, job_logs, read_jsonl

sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from e2e_helpers import TINY  # noqa: E402

# a warm start built by the driver (model.sft_checkpoint=auto), as cheap as it gets: the copy phase on demonstrations
# that all search, until the probe's policy searches now and then (4 to 6 epochs, ~15 s; the probe's other demands
# off): the RL steps then search, and each search goes from a worker host to the driver's retriever. Turns long
# enough for the demonstrations' reasoning before the search tag.
WARM_START = ["model.sft_checkpoint=auto", "warm_start.n_demos=64", "warm_start.copy_epochs=10"]
WARM_START += ["warm_start.copy_p_no_search=0", "warm_start.until_em=0", "warm_start.min_searched=2"]
WARM_START += ["warm_start.mix_epochs=0", "warm_start.mix_keeps_em=0", "warm_start.probe_questions=8"]
WARM_START += ["rollout.max_tokens_per_turn=64", "rollout.max_response_length=192"]


def worker_hosts(cluster, cls: str) -> list[int]:
    """The worker hosts an actor of class `cls` ran on: Ray writes `:actor_name:<class>` into the actor's log, on the
    host's private /tmp."""
    pattern = f"grep -lx ':actor_name:{cls}' /tmp/ray/session_latest/logs/*.out 2>/dev/null | head -1"
    return [i for i in range(cluster.n_hosts) if cluster.host_run(i, pattern).stdout.strip()]


def overrides(cluster, *extra: str) -> list[str]:
    run_dir = os.path.join(cluster.shared, "run")
    toy = os.path.join(cluster.driver_dir, "toy_world")  # the driver's private disk: no worker host sees it
    paths = [f"trainer.run_dir={run_dir}", f"data.toy_world.cache_dir={toy}"]
    return ["+recipe=search_r1_ppo", *TINY, *WARM_START, *paths, *extra]


@pytest.mark.slow
def test_ppo_two_hosts_then_resume_on_one(netns_cluster):
    cluster = netns_cluster
    run_dir = os.path.join(cluster.shared, "run")
    done = cluster.submit(overrides(cluster, "trainer.n_workers=2", "trainer.nnodes=2"))
    assert done.returncode == 0, job_logs(cluster, done)
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r.get("search/errors", 0) == 0 for r in rows), rows
    assert sum(r.get("search/calls", 0) for r in rows) > 0, rows
    config = yaml.safe_load(pathlib.Path(run_dir, "config.yaml").read_text())
    # what the workers load comes from the run directory, not from the driver's cache (data.toy_world.cache_dir)
    for key in ("tokenizer_path", "sft_checkpoint"):
        assert config["model"][key].startswith(os.path.join(run_dir, "published") + os.sep), config["model"]
    assert config["retriever"]["url"].startswith(f"http://{cluster.head_ip}:")  # the driver's cluster address
    # the workers ran on both hosts: their Ray logs are on each host's private /tmp
    assert worker_hosts(cluster, "ActorWorker") == [0, 1]
    ckpt = os.path.join(run_dir, "checkpoints", "step_000002")
    assert os.path.isfile(os.path.join(ckpt, "COMPLETE"))
    shards = sorted(os.path.relpath(p, ckpt) for p in glob.glob(os.path.join(ckpt, "**", "*"), recursive=True))
    assert any("rank1" in s or "__1_" in s for s in shards), shards  # rank 1's shard, written on the other host

    cluster.stop_host(1)
    cluster.wait_nodes(2)
    done = cluster.submit(overrides(cluster, "trainer.n_workers=1", "trainer.nnodes=1", "trainer.total_steps=3"))
    assert done.returncode == 0, job_logs(cluster, done)
    assert "resuming from" in done.stdout + done.stderr
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert rows[-1]["step"] == 3 and all(r.get("search/errors", 0) == 0 for r in rows), rows
    summary = json.loads(pathlib.Path(run_dir, "summary.json").read_text())
    assert summary["steps"] == 3


@pytest.mark.slow
def test_grpo_split_placement_syncs_weights_across_hosts(netns_cluster):
    """One actor rank and one rollout worker, each pool a 1-CPU placement group: the hosts have 1 CPU each, so the
    pools land on different hosts and rank 0's `ray.put` of the weights reaches the rollout worker over the network.
    A random tiny policy (plumbing, not learning), 2 steps, no validation before training."""
    cluster = netns_cluster
    run_dir = os.path.join(cluster.shared, "run")
    toy = os.path.join(cluster.driver_dir, "toy_world")
    split = ["trainer.placement=split", "trainer.n_workers=1", "trainer.nnodes=1", "trainer.val_before_train=false"]
    # weights that move at step 1 (entropy bonus, big lr) so a stale rollout engine would show in step 2's gap
    split += ["rollout.n=2", "actor.entropy_coeff=0.01", "actor.optim.lr=1e-3"]
    paths = [f"trainer.run_dir={run_dir}", f"data.toy_world.cache_dir={toy}"]
    done = cluster.submit(["+recipe=search_r1_grpo", *TINY, *split, *paths])
    assert done.returncode == 0, job_logs(cluster, done)
    actor, rollout = worker_hosts(cluster, "ActorWorker"), worker_hosts(cluster, "GenerationWorker")
    assert len(actor) == len(rollout) == 1 and actor != rollout, (actor, rollout)
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2], rows
    assert all(r["sync/bytes"] > 0 for r in rows), rows  # split: rank 0's copy in the object store
    assert rows[0]["actor/grad_norm"] > 0, rows[0]
    # step 2 sampled on the other host with the weights synced after step 1's update: the gap is only measured on
    # tokens the engine tagged version 1 (absent if the sync never landed), and engine and actor agree there (fp32)
    assert rows[1]["rollout/logprob_abs_diff_max"] < 1e-3, rows[1]
    assert all(r.get("search/errors", 0) == 0 for r in rows), rows  # searches from the rollout host, if any
