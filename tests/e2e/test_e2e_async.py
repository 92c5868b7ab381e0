"""Cross-step asynchronous training end to end (real main jobs, local Ray, split placement on 2 CPUs).

* staleness 0 on split workers (2 FSDP ranks, 2 rollout workers) is the synchronous loop: the same metrics, bit for
  bit, as the colocated run, and the rollout engines sample with the weights of the last update;
* staleness 1 runs ahead (every batch after the first is one update old) and never beyond the bound, with the
  off-policy weights and idle times logged; a run resumed from a checkpoint written while a batch was being generated
  ahead, and a run rolled back by the health watchdog while one was, train the same prompts at the same steps as the
  uninterrupted run: none lost, none twice.
"""

import json
import os

import pytest
from e2e_helpers import hf_weights, read_metrics, run_main

from rsearch_verl.testing.faults import nan_loss_env

ASYNC = ["trainer.placement=split", "trainer.ray_num_cpus=2", "rollout.n=2", "actor.ppo_mini_batch_size=4"]
# values that measure time or this machine, not the run's maths
VOLATILE = ("timing/", "search/latency", "search/batch", "retriever/", "sync/")  # sync/bytes: 0 when colocated


def _prompts_per_step(run_dir) -> dict[int, list[int]]:
    out = {}
    for name in os.listdir(os.path.join(run_dir, "rollouts")):
        step = int(name.split("_")[1].split(".")[0])
        with open(os.path.join(run_dir, "rollouts", name)) as f:
            out[step] = sorted(json.loads(line)["index"] for line in f)
    return out


def _maths(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


@pytest.mark.slow
def test_staleness_zero_on_split_workers_is_the_synchronous_loop(tmp_path, toy_cache):
    """2 FSDP ranks with stand-alone rollout workers (weights travel actor -> driver -> rollout workers after every
    update) give the colocated run's metrics, bit for bit."""
    colocated, split = tmp_path / "colocated", tmp_path / "split"
    common = [
        "rollout.n=2",
        "actor.ppo_mini_batch_size=4",
        "trainer.n_workers=2",
        "actor.entropy_coeff=0.01",
        "actor.optim.lr=1e-3",  # big enough that stale rollout weights would show in the log-prob gap
        "rollout.temperature=0.7",  # the actor's log-probs are taken at the same temperature
        "rollout.top_p=1.0",
    ]
    run_main("search_r1_grpo", colocated, toy_cache, *common)
    # 2 actor + 2 rollout bundles (logical CPUs; the machine may have 2 cores)
    run_main("search_r1_grpo", split, toy_cache, *common, "trainer.placement=split", "trainer.ray_num_cpus=4")
    a, b = read_metrics(colocated), read_metrics(split)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2]
    assert [_maths(r) for r in a] == [_maths(r) for r in b]
    assert b[2]["actor/grad_norm"] > 0 and b[2]["async/staleness_max"] == 0
    assert "off_policy/is_weight_mean" not in b[2]  # no correction when nothing is stale
    # step 2 samples with the weights synced after step 1's update: engine and actor log-probs agree (both at T=0.7)
    assert b[2]["rollout/logprob_abs_diff_max"] < 1e-3, b[2]
    assert b[2]["timing/rollout_idle_s"] > 0 and b[2]["timing/actor_idle_s"] > 0  # split: each waits for the other
    weights = hf_weights(str(split / "checkpoints" / "step_000002"))
    assert weights and all(v.isfinite().all() for v in weights.values())


@pytest.mark.slow
def test_staleness_one_stays_in_bound_and_resume_or_rollback_loses_no_prompt(tmp_path, toy_cache):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    steps = ["trainer.total_steps=4", "trainer.save_freq=2", "trainer.test_freq=0"]
    run_main("search_r1_grpo", whole, toy_cache, *ASYNC, *steps, "trainer.max_staleness=1")
    rows = [r for r in read_metrics(whole) if "async/staleness_max" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["async/dropped_stale"] == 0 for r in rows)
    # batch 1 needs the initial weights; every later one was generated while the previous step trained
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert all(0 < r["off_policy/is_weight_mean"] <= 2 for r in rows)
    prompts = _prompts_per_step(whole)
    flat = [i for s in sorted(prompts) for i in prompts[s]]
    assert len(set(flat)) == len(flat) // 2  # each prompt once per step (x rollout.n), never in two steps
    # the checkpoint of step 2 was written while batch 3 was being generated: a resume generates it again
    ckpt = whole / "checkpoints" / "step_000002"
    run_main("search_r1_grpo", resumed, toy_cache, *ASYNC, *steps, "trainer.max_staleness=1", f"trainer.resume={ckpt}")
    again = _prompts_per_step(resumed)
    assert sorted(again) == [3, 4]
    assert again == {s: prompts[s] for s in (3, 4)}
    # a NaN loss at step 3 (batch 4 is being generated ahead): the watchdog rolls back to step 2, both batches are
    # forgotten and generated again from the restored weights
    rolled = tmp_path / "rolled"
    async1 = [*ASYNC, *steps, "trainer.max_staleness=1"]
    run_main("search_r1_grpo", rolled, toy_cache, *async1, env=nan_loss_env(3))
    health = json.loads((rolled / "summary.json").read_text())["health"]
    assert [(r["step"], r["restored_step"]) for r in health["rollbacks"]] == [(3, 2)]
    assert _prompts_per_step(rolled) == prompts
    rows = [r for r in read_metrics(rolled) if "async/staleness_max" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[2]["health/rolled_back_from"] == 3
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 0, 1]  # batch 3 again: from the restored weights
