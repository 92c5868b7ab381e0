"""The toy world's main job learns to search: the short version of benchmarks/learning.py.

The README's main command as a newcomer runs it (`python -m rsearch_verl.main +recipe=search_r1_ppo`: the warm
start trained from scratch, local Ray, the recipe's own BM25 retrieval server, PPO with observation masking, the
default sizes), only with its run and cache directories in a temp dir; ~9 min on 2 cores, most of it the warm start.
Validation before the first update is the warm start, whose greedy policy answers from "memory" (it was shown more
answers without a search than with one): EM ~0.0-0.05 and no search. After 20 RL steps it must search and read:
held-out EM up by >= 0.25 (the issue's target; measured +0.5 to +0.6) and searches per question up by >= 0.5.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from e2e_helpers import ROOT, child_env


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_main_job_learns_to_search(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rsearch_verl.main", "+recipe=search_r1_ppo", f"trainer.run_dir={run_dir}"]
    cmd += [f"data.toy_world.cache_dir={tmp_path / 'toy'}", "trainer.save_freq=0", "trainer.dump_rollouts=false"]
    env = child_env()
    env.pop("OMP_NUM_THREADS")  # torch's own thread count, as in the README's command
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stderr[-4000:]
    with open(run_dir / "metrics.jsonl") as f:
        vals = [row for row in map(json.loads, f) if "val/em" in row]
    before, after = vals[0], vals[-1]
    assert before["step"] == 0 and after["step"] == 20
    assert after["val/em"] >= before["val/em"] + 0.25, [(v["step"], v["val/em"]) for v in vals]
    assert after["val/searches_mean"] >= before["val/searches_mean"] + 0.5, (before, after)
    with open(run_dir / "summary.json") as f:
        summary = json.load(f)
    assert summary["val/em_after"] == after["val/em"] and summary["val/em_before"] == before["val/em"]
