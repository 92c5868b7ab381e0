"""benchmarks/smollm2_learning.py's report: per step the correct trajectories by question kind (read from the run's
rollout dumps, '?' for a step without one), validation EM by kind before and after RL."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    path = os.path.join(ROOT, "benchmarks", "smollm2_learning.py")
    spec = importlib.util.spec_from_file_location("smollm2_learning_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step(step, reward):
    return {"step": step, "reward/mean": reward, "rollout/searches_mean": 1.0, "actor/grad_norm": 0.5,
            "rollout/logprob_abs_diff_max": 1e-5, "timing/step_s": 60.0}  # fmt: skip


def _val(step, em, one, two):
    return {"step": step, "val/em": em, "val/searches_mean": 1.0, "val/toy_world_1hop/em": one,
            "val/toy_world_2hop/em": two}  # fmt: skip


def test_report_counts_correct_trajectories_by_kind_and_val_by_kind(tmp_path):
    bench = _bench()
    dumps = tmp_path / "rl" / "rollouts"
    dumps.mkdir(parents=True)
    rows = [(1.0, "toy_world_1hop"), (0.0, "toy_world_1hop"), (1.0, "toy_world_1hop"), (0.5, "toy_world_2hop")]
    with open(dumps / "step_1.jsonl", "w") as f:
        for reward, source in rows:
            f.write(json.dumps({"reward": reward, "data_source": source, "n_searches": 1}) + "\n")
    rl = [_val(0, 0.5, 1.0, 0.0), _step(1, 0.5), {**_step(2, 0.0), **_val(2, 0.625, 1.0, 0.25)}]  # as metrics.jsonl
    probes = [{"stage": "zero-shot", "search_rate": 0.0, "searched_em": 0.0, "no_search_em": 0.0, "n": 8,
               "probe_s": 1.0}]  # fmt: skip
    args = argparse.Namespace(out=str(tmp_path), recipe="search_r1_grpo", val_questions=16)
    lines = bench.report(probes, rl, args)
    step1 = next(line for line in lines if line.startswith("  step  1"))
    assert step1.endswith("correct: 1hop 2/3  2hop 0/1"), step1  # a partial reward (0.5) is not correct
    assert next(line for line in lines if line.startswith("  step  2")).endswith("correct: ?")
    val = next(line for line in lines if line.startswith("  val"))
    assert "em 0.500 -> 0.625 (1hop 1.000 -> 1.000; 2hop 0.000 -> 0.250)" in val, val
