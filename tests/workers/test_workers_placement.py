"""GPU placement on a real Ray cluster that advertises 8 GPUs (no GPU needed): PPO colocated (actor + critic share
each GPU, half each), GRPO colocated (a whole GPU per actor), split 6 train + 2 generate, and a cluster too small or
too busy erroring within trainer.placement_timeout_s with the keys named.

The cluster is a `ray start --head --num-gpus=8` of our own (unique temp dir and port). Pools, bundles, the GPU share
per worker and the timeouts are the product's (`build_worker_groups`); only the worker class is a probe
(rsearch_verl/testing/placement_probe.py): the real ones initialise CUDA and NCCL in `init_model`, which this machine
cannot, so the probe records what Ray gave it (`ray.get_gpu_ids()`, the assigned GPU share, the placement group).

Run: .venv/bin/python -m pytest -q tests/workers/test_workers_placement.py          (the Ray cluster ones are slow)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import ray

from rsearch_verl.config import load_config
from rsearch_verl.frozen import ConfigError
from rsearch_verl.testing.placement_probe import probe_worker_classes
from rsearch_verl.workers.placement import build_worker_groups
from rsearch_verl.workers.pools import PlacementError, PoolSpec, assign_nodes, pool_specs, release_pools

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
# batch sizes that divide 6, 8 and 16 ranks, so the configs validate whatever recipes/trainer/gpu_1x8.yaml says
BATCH = ["data.train_batch_size=48", "actor.ppo_mini_batch_size=48", "critic.ppo_mini_batch_size=48"]
MICRO = ["actor.micro_batch_size=1", "critic.micro_batch_size=1"]
PPO = ["trainer=gpu_1x8", "algorithm.adv_estimator=gae", "rollout.n=1", *BATCH, *MICRO]
GRPO = ["trainer=gpu_1x8", "algorithm.adv_estimator=grpo", "rollout.n=2", *BATCH, *MICRO]
SPLIT = ["trainer.placement=split", "trainer.rollout_gpus_per_node=2"]


def cfg_of(*overrides: str):
    timeout = (
        []
        if any(o.startswith("trainer.placement_timeout_s=") for o in overrides)
        else ["trainer.placement_timeout_s=20"]
    )
    return load_config([*overrides, *timeout])


# ------------------------------------------------------------------------------------------ pure: specs, check


def test_pool_specs_share_gpus_with_the_critic_and_split_each_node():
    ppo, grpo, split = pool_specs(cfg_of(*PPO)), pool_specs(cfg_of(*GRPO)), pool_specs(cfg_of(*PPO, *SPLIT))
    assert ppo["actor"].per_node == (8,) and ppo["actor"].colocate == 2 and "rollout" not in ppo
    assert ppo["actor"].bundle == {"CPU": 2.0, "GPU": 1.0}
    assert grpo["actor"].per_node == (8,) and grpo["actor"].colocate == 1
    assert split["actor"].per_node == (6,) and split["rollout"].per_node == (2,) and split["rollout"].colocate == 1
    assert cfg_of(*PPO, *SPLIT).world_size == 6 and cfg_of(*PPO).world_size == 8


def test_split_share_is_validated_with_the_key_named():
    for share in ("0", "8"):
        with pytest.raises(ConfigError, match="trainer.rollout_gpus_per_node"):
            cfg_of(*GRPO, "trainer.placement=split", f"trainer.rollout_gpus_per_node={share}")


def test_assign_nodes_names_the_keys_and_what_the_cluster_has():
    specs = list(pool_specs(cfg_of(*PPO)).values())
    assign_nodes(specs, [{"GPU": 8.0, "CPU": 16.0}])
    with pytest.raises(PlacementError, match=r"trainer.n_gpus_per_node.*GPUs \[4.0\]"):
        assign_nodes(specs, [{"GPU": 4.0, "CPU": 16.0}])
    with pytest.raises(PlacementError, match="trainer.nnodes"):  # 2 x 4 GPUs: no node holds an 8-GPU group
        assign_nodes(specs, [{"GPU": 4.0, "CPU": 16.0}] * 2)
    split = list(pool_specs(cfg_of(*PPO, *SPLIT, "trainer.nnodes=2")).values())
    assign_nodes(split, [{"GPU": 8.0, "CPU": 16.0}] * 2)  # 6 + 2 on each node
    with pytest.raises(PlacementError, match="trainer.rollout_gpus_per_node"):
        assign_nodes(split, [{"GPU": 8.0, "CPU": 16.0}, {"GPU": 4.0, "CPU": 16.0}])
    assert assign_nodes([PoolSpec("actor", (2,), False, 1, "trainer.n_workers=2")], [{"CPU": 2.0}]) == {"actor": [0]}


# ------------------------------------------------------------------------------------------ a Ray cluster with 8 GPUs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_cluster(head: subprocess.Popen, temp_dir: str) -> None:
    """Stop only our cluster: `ray stop` would stop every Ray on the machine (other engineers' too). The head was
    started in its own session; its processes (and any that left the group) all name our temp dir."""
    try:
        os.killpg(head.pid, signal.SIGKILL)  # a throwaway cluster: nothing to flush
        head.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if temp_dir.encode() in f.read():
                    os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass


@pytest.fixture(scope="module")
def gpu_cluster():
    temp_dir = tempfile.mkdtemp(prefix="rplc", dir="/tmp")  # short: Ray's socket paths must stay < 108 chars
    port = _free_port()
    cmd = [RAY, "start", "--head", "--block", "--num-gpus=8", "--num-cpus=16", f"--port={port}",
           f"--temp-dir={temp_dir}", "--include-dashboard=false", f"--ray-client-server-port={_free_port()}",
           f"--node-manager-port={_free_port()}", f"--object-manager-port={_free_port()}",
           "--object-store-memory=100000000"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_prestart_worker_first_driver"] = "0"  # no idle worker per CPU: 16 processes the 2 cores don't need
    # The head's auth mode follows this (driver) process's, which Ray fixes for good: disabled in a fresh process
    # (then the head gets its own HOME, so a token another job left in ~/.ray/auth_token is not demanded), token once
    # an earlier local ray.init in this pytest process switched to it (then both read ~/.ray/auth_token; a
    # token-mode driver's actors never start on a token-less head)
    if os.environ.get("RAY_AUTH_MODE") == "token":
        env["RAY_AUTH_MODE"] = "token"
    else:
        env.update(HOME=temp_dir, RAY_AUTH_MODE="disabled")
    log = open(os.path.join(temp_dir, "head.log"), "wb")  # noqa: SIM115 (closed in the finalizer)
    head = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
                break
            except (ConnectionError, RuntimeError):
                if time.monotonic() > deadline or head.poll() is not None:
                    raise
                time.sleep(1)
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _kill_cluster(head, temp_dir)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


PROBES = probe_worker_classes()


def _teardown(groups) -> None:
    """Kill the workers and remove the placement groups, so the next placement starts from an empty cluster."""
    pools = {id(g.resource_pool): g.resource_pool for g in (groups.actor, groups.critic, groups.split_rollout) if g}
    for g in (groups.actor, groups.critic, groups.split_rollout):
        for w in g.workers if g else []:
            ray.kill(w)
    release_pools(pools.values())


def _place(cfg) -> dict[str, list[dict]]:
    """Where each role's workers landed. No time bound: 8-16 worker processes start on 2 shared cores in 20-90 s
    depending on the machine; a placement that cannot fit fails within trainer.placement_timeout_s (the last test),
    and pytest's timeout catches a hang."""
    groups = build_worker_groups(cfg, PROBES)
    try:
        roles = {"actor": groups.actor, "critic": groups.critic, "rollout": groups.split_rollout}
        where = {role: g.where() for role, g in roles.items() if g is not None}
        if groups.split_rollout is not None:
            where["rollout_version"] = groups.split_rollout.policy_version()
    finally:
        _teardown(groups)
    for role, workers in where.items():
        if role != "rollout_version":  # probe processes load neither torch nor verl (probe_worker.py)
            assert all(w["heavy"] == [] for w in workers), (role, workers)
    return where


def _assert_distinct_gpus(workers: list[dict], share: float) -> None:
    assert [w["gpu"] for w in workers] == [share] * len(workers)
    assert all(len(w["gpu_ids"]) == 1 and w["visible"] == str(w["gpu_ids"][0]) for w in workers)
    assert len({w["gpu_ids"][0] for w in workers}) == len(workers), "two ranks of one group on one GPU"


@pytest.mark.slow
def test_ppo_colocated_actor_and_critic_share_each_gpu(gpu_cluster):
    where = _place(cfg_of(*PPO))
    actor, critic = where["actor"], where["critic"]
    assert len(actor) == len(critic) == 8
    _assert_distinct_gpus(actor, 0.5)
    _assert_distinct_gpus(critic, 0.5)
    for a, c in zip(actor, critic, strict=True):  # rank r of both groups: the same bundle, the same GPU
        assert a["rank"] == c["rank"] and a["gpu_ids"] == c["gpu_ids"] and a["pg"] == c["pg"]


@pytest.mark.slow
def test_grpo_colocated_one_whole_gpu_per_actor(gpu_cluster):
    where = _place(cfg_of(*GRPO))
    assert set(where) == {"actor"} and len(where["actor"]) == 8
    _assert_distinct_gpus(where["actor"], 1.0)


@pytest.mark.slow
def test_split_six_train_two_generate(gpu_cluster):
    where = _place(cfg_of(*GRPO, *SPLIT))  # the critic's share of the actor pool: as colocated (specs test)
    actor, rollout = where["actor"], where["rollout"]
    assert set(where) == {"actor", "rollout", "rollout_version"}
    assert (len(actor), len(rollout)) == (6, 2)
    _assert_distinct_gpus(actor, 1.0)
    _assert_distinct_gpus(rollout, 1.0)
    train, gen = {a["gpu_ids"][0] for a in actor}, {r["gpu_ids"][0] for r in rollout}
    assert not train & gen and len(train | gen) == 8  # the node's 8 GPUs, divided
    assert where["rollout_version"] == [0, 0]  # the start-up sync reached both rollout workers


@pytest.mark.slow
def test_too_small_or_busy_cluster_errors_fast(gpu_cluster):
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"trainer.nnodes.*GPUs \[8.0\]"):  # 16 GPUs asked of an 8-GPU node
        build_worker_groups(cfg_of(*GRPO, "trainer.nnodes=2"), PROBES)
    assert time.monotonic() - start < 10
    # enough GPUs in total, but another job holds 4 of them: the wait ends at trainer.placement_timeout_s
    holder = ray.util.placement_group([{"GPU": 1.0, "CPU": 1.0}] * 4, strategy="STRICT_PACK")
    assert holder.wait(30)
    try:
        start = time.monotonic()
        with pytest.raises(PlacementError, match="trainer.placement_timeout_s"):
            build_worker_groups(cfg_of(*GRPO, "trainer.placement_timeout_s=2"), PROBES)
        assert time.monotonic() - start < 10
    finally:
        ray.util.remove_placement_group(holder)
    # the timed-out request left nothing pending (removal is asynchronous: poll), and no worker was started
    deadline = time.monotonic() + 10
    while ray.available_resources().get("GPU") != 8.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU") == 8.0
    assert {pg["state"] for pg in ray.util.placement_group_table().values()} == {"REMOVED"}
