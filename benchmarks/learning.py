"""Does the toy world's main job learn? Warm start vs after RL on held-out questions, by running the real main job
(`python -m rsearch_verl.main`, local Ray, the recipe's own BM25 server, the cached SFT warm start) once per variant
and reading its metrics.jsonl: validation before the first update (= the warm start) and at the end.

Variants (same seed, data and warm start): PPO (search_r1_ppo) with observation masking, PPO without masking
(`actor.mask_observations=false`, Search-R1's ablation), GRPO (search_r1_grpo, rollout.n=4 x 4 prompts: the same
16 trajectories per step as PPO's 16 prompts) with masking.
Columns: EM on all held-out questions and on the 2-hop ones, searches per question, before -> after.
Prints a table; the last line is the headline: the EM gain of PPO with masking (target >= 0.25 absolute).

    .venv/bin/python benchmarks/learning.py                       # total_steps of the trainer group (cpu: 20)
    .venv/bin/python benchmarks/learning.py --steps 40 --only ppo --extra data.toy_world.cache_dir=/tmp/tw

Measured (2 CPU cores, toy world v3 defaults: 64 held-out questions, half 2-hop; 20 steps of 16 trajectories; one
seed; the first variant's wall time includes building the world and the warm start, ~9 min):
    variant                val EM         2-hop EM       searches/q   wall s
    ppo            0.016 -> 1.000   0.000 -> 1.000   0.000 -> 1.500      675
    ppo_nomask     0.016 -> 0.891   0.000 -> 0.969   0.000 -> 1.438      142
    grpo           0.016 -> 0.984   0.000 -> 0.969   0.000 -> 1.500      118
    masking: EM after RL 1.000 with vs 0.891 without
    headline: RL EM gain over the warm start +0.984 (target >= +0.25)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "ppo": ["+recipe=search_r1_ppo"],
    "ppo_nomask": ["+recipe=search_r1_ppo", "actor.mask_observations=false"],
    # the same 16 trajectories per step as PPO's 16 prompts x 1
    "grpo": ["+recipe=search_r1_grpo", "rollout.n=4", "data.train_batch_size=4"],
}
QUIET = ["trainer.save_freq=0", "trainer.test_freq=0", "trainer.dump_rollouts=false"]


def run_variant(name: str, steps: int | None, extra: list[str], out_root: str) -> dict:
    """Run the main job for one variant; return its first and last validation rows and the wall time."""
    run_dir = os.path.join(out_root, name)
    cmd = [sys.executable, "-m", "rsearch_verl.main", *VARIANTS[name], *QUIET, f"trainer.run_dir={run_dir}", *extra]
    if steps is not None:
        cmd.append(f"trainer.total_steps={steps}")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: main job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        vals = [row for row in map(json.loads, f) if "val/em" in row]
    return {"before": vals[0], "after": vals[-1], "wall_s": wall}


def _cell(before: dict, after: dict, key: str) -> str:
    if key not in before or key not in after:
        return "n/a"
    return f"{before[key]:.3f} -> {after[key]:.3f}"


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="trainer.total_steps (default: the trainer group's)")
    parser.add_argument("--only", default=",".join(VARIANTS), help="comma-separated variants: " + ",".join(VARIANTS))
    parser.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every variant")
    parser.add_argument("--out", default=None, help="directory for the run dirs (default: a temp dir)")
    args = parser.parse_args(argv)
    out_root = args.out or tempfile.mkdtemp(prefix="rsearch-learning-")
    results = {name: run_variant(name, args.steps, args.extra, out_root) for name in args.only.split(",")}
    header = f"{'variant':<12} {'val EM':>16} {'2-hop EM':>16} {'searches/q':>16} {'wall s':>8}"
    print(header)  # noqa: T201
    for name, r in results.items():
        b, a = r["before"], r["after"]
        row = [_cell(b, a, "val/em"), _cell(b, a, "val/toy_world_2hop/em"), _cell(b, a, "val/searches_mean")]
        print(f"{name:<12} {row[0]:>16} {row[1]:>16} {row[2]:>16} {r['wall_s']:>8.0f}")  # noqa: T201
    if "ppo" in results and "ppo_nomask" in results:
        em = {k: results[k]["after"]["val/em"] for k in ("ppo", "ppo_nomask")}
        print(f"masking: EM after RL {em['ppo']:.3f} with vs {em['ppo_nomask']:.3f} without")  # noqa: T201
    head = results.get("ppo") or next(iter(results.values()))
    gain = head["after"]["val/em"] - head["before"]["val/em"]
    print(f"headline: RL EM gain over the warm start {gain:+.3f} (target >= +0.25)")  # noqa: T201
    return results


if __name__ == "__main__":
    main()
