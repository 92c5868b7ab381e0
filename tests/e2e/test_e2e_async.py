"""Cross-step asynchronous training end to end (real main jobs, local Ray, split placement on 2 CPUs).

* staleness 0 on split workers is the synchronous loop: the same metrics, bit for bit, as the colocated run;
* staleness 1 runs ahead (every batch after the first is one update old) and never beyond the bound, with the
  off-policy weights and idle times logged; a run resumed from a checkpoint written while a batch was being generated
  ahead trains the same prompts at the same steps as the uninterrupted run: none lost, none twice.
"""

import json
import os

import pytest
from e2e_helpers import read_metrics, run_main

ASYNC = ["trainer.placement=split", "trainer.ray_num_cpus=2", "rollout.n=2", "actor.ppo_mini_batch_size=4"]
# values that measure time or this machine, not the run's maths
VOLATILE = ("timing/", "search/latency", "search/batch", "retriever/")


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
    colocated, split = tmp_path / "colocated", tmp_path / "split"
    run_main("search_r1_grpo", colocated, toy_cache, "rollout.n=2", "actor.ppo_mini_batch_size=4")
    run_main("search_r1_grpo", split, toy_cache, *ASYNC, "trainer.max_staleness=0")
    a, b = read_metrics(colocated), read_metrics(split)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2]
    assert [_maths(r) for r in a] == [_maths(r) for r in b]
    assert b[2]["async/staleness_max"] == 0 and "off_policy/is_weight_mean" not in b[2]
    assert b[2]["timing/rollout_idle_s"] > 0 and b[2]["timing/actor_idle_s"] > 0  # split: each waits for the other


@pytest.mark.slow
def test_staleness_one_stays_in_bound_and_resume_loses_no_prompt(tmp_path, toy_cache):
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
