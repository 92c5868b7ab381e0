"""`trainer.cpu_threads`: the torch (OpenMP) threads of each CPU worker process. Ray gives an actor that asks for no
CPU one thread, so a colocated worker on a 2-core machine trained on one core; `auto` shares the node's CPUs among
the processes that compute at once.

Run: .venv/bin/python -m pytest -q tests/workers/test_workers_threads.py   (the Ray one starts a local cluster, ~15 s)
"""

from __future__ import annotations

import pytest
import ray

from rsearch_verl.config import load_config
from rsearch_verl.frozen import ConfigError
from rsearch_verl.testing.placement_probe import probe_worker_classes
from rsearch_verl.workers.placement import build_worker_groups, thread_env

SPLIT = ["trainer.placement=split", "trainer.max_staleness=1"]
PPO = "+recipe=search_r1_ppo"
TWO = ["trainer.n_workers=2", "actor.micro_batch_size=1", "critic.micro_batch_size=1"]  # ranks


def threads(*overrides: str, cpus: int = 8, environ: dict | None = None) -> str | None:
    env = thread_env(load_config([PPO, *overrides]), node_cpus=cpus, environ=environ or {})
    assert env.get("OMP_NUM_THREADS") == env.get("MKL_NUM_THREADS")
    return env.get("OMP_NUM_THREADS")


def test_auto_shares_the_node_among_the_processes_that_compute_at_once():
    assert threads("trainer.cpu_threads=auto", cpus=2) == "2"  # colocated: one actor rank holds the engine too
    assert threads("trainer.cpu_threads=auto", *TWO, cpus=8) == "4"
    assert threads("trainer.cpu_threads=auto", *SPLIT, cpus=2) == "1"  # the rollout worker generates meanwhile
    assert threads("trainer.cpu_threads=auto", *TWO, "trainer.nnodes=2", cpus=4) == "4"
    assert threads("trainer.cpu_threads=auto", cpus=1) == "1"
    # the driver's OMP_NUM_THREADS caps it (benchmarks/learning.py --jobs 2 runs two jobs on one machine)
    assert threads("trainer.cpu_threads=auto", cpus=8, environ={"OMP_NUM_THREADS": "1"}) == "1"


def test_ray_default_explicit_counts_and_gpus():
    assert threads() is None  # "ray": nothing set, the behaviour before this setting existed
    assert threads("trainer.cpu_threads=3", cpus=2) == "3"
    assert threads("trainer.cpu_threads=auto", "trainer=gpu_1x8", "data.train_batch_size=48",
                   "actor.ppo_mini_batch_size=48", "critic.ppo_mini_batch_size=48", *TWO[1:]) is None  # fmt: skip


@pytest.mark.parametrize("bad", ["0", "many", "-1"])
def test_bad_values_are_refused_with_the_key(bad):
    with pytest.raises(ConfigError, match="trainer.cpu_threads"):
        load_config([PPO, f"trainer.cpu_threads={bad}"])


def test_the_workers_get_them_on_a_real_ray_cluster():
    if ray.is_initialized():  # a cluster of another test: this one needs its own 4 CPUs
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        groups = build_worker_groups(load_config([PPO, "trainer.cpu_threads=auto", *SPLIT]), probe_worker_classes())
        assert [w["omp"] for w in groups.actor.where()] == ["2"]  # 4 CPUs, an actor rank and a rollout worker
        assert [w["omp"] for w in groups.split_rollout.where()] == ["2"]
    finally:
        ray.shutdown()
