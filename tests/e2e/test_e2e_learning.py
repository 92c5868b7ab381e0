"""The toy world's main job learns to search for every RL seed and on another world: the short benchmarks/learning.py.

The README's main command as a newcomer runs it (`python -m rsearch_verl.main +recipe=search_r1_ppo`: the warm start
trained from scratch, local Ray, the recipe's own BM25 retrieval server, PPO with observation masking, the default
sizes), only with its run and cache directories in a temp dir, for RL seeds 1, 2, 3 on the default world (one
cached warm start: its seed is model.warm_start_seed, not the RL seed) and RL seed 1 on world 1 (a second warm
start). Validation before the first update is the warm start, whose greedy policy answers from "memory": EM ~0 and
no search. After 20 RL steps every run must search and read: held-out EM up by >= 0.25 and searches per question up
by >= 0.5 (the distribution over 15 runs per recipe is in docs/toy_world_learning.md).

Outside CI's command (marked `learning`): two warm starts of ~13 min and four runs of ~2.5 min made it 37 of CI's
87 minutes on a 2-core machine. Run it before calling a change to training, rollout or the warm start done:

    .venv/bin/python -m pytest -q -m learning          # ~35-40 min on 2 cores
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from e2e_helpers import ROOT, child_env

RUNS = [(1, 0), (2, 0), (3, 0), (1, 1)]  # (RL seed, data.toy_world.seed)


def run_main_job(tmp_path, seed: int, world: int) -> tuple[list[dict], dict]:
    run_dir = tmp_path / f"run-s{seed}-w{world}"
    cmd = [sys.executable, "-m", "rsearch_verl.main", "+recipe=search_r1_ppo", f"trainer.run_dir={run_dir}"]
    cmd += [f"seed={seed}", f"data.toy_world.seed={world}", f"data.toy_world.cache_dir={tmp_path / 'toy'}"]
    cmd += ["trainer.save_freq=0", "trainer.dump_rollouts=false"]
    env = child_env()
    env.pop("OMP_NUM_THREADS")  # torch's own thread count, as in the README's command
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    with open(run_dir / "metrics.jsonl") as f:
        vals = [row for row in map(json.loads, f) if "val/em" in row]
    with open(run_dir / "summary.json") as f:
        return vals, json.load(f)


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.timeout(3600)
def test_main_job_learns_to_search_for_every_seed_and_world(tmp_path):
    outcomes = {}
    for seed, world in RUNS:
        vals, summary = run_main_job(tmp_path, seed, world)
        before, after = vals[0], vals[-1]
        assert before["step"] == 0 and after["step"] == 20
        assert summary["val/em_after"] == after["val/em"] and summary["val/em_before"] == before["val/em"]
        outcomes[(seed, world)] = {
            "em": (before["val/em"], after["val/em"]),
            "searches": (before["val/searches_mean"], after["val/searches_mean"]),
            "warm_start": summary["warm_start"],
        }
    # every run of a world starts from the same warm start: its seed is not the RL seed
    assert len({json.dumps(outcomes[(s, 0)]["warm_start"], sort_keys=True) for s in (1, 2, 3)}) == 1
    for (seed, world), o in outcomes.items():
        (em0, em1), (s0, s1) = o["em"], o["searches"]
        assert em1 >= em0 + 0.25 and s1 >= s0 + 0.5, (seed, world, outcomes)
