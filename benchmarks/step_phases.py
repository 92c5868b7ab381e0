"""CPU training-step time and its phases (gen / old log-prob / ref / values / updates / sync), measured by running the
real main job (`python -m rsearch_verl.main`, local Ray, the recipe's own retrieval server) and reading the
`timing/*` metrics each step writes to metrics.jsonl.

Two configurations in the same run, same recipe, data and seed: the baseline is one FSDP rank (`trainer.n_workers=1`)
and the candidate two ranks over gloo (`trainer.n_workers=2`). The first step is warm-up and not counted.
Prints a table (mean seconds per phase) and a last line with the ratio of mean step times.

    .venv/bin/python benchmarks/step_phases.py                   # search_r1_ppo, 4 steps each
    .venv/bin/python benchmarks/step_phases.py --recipe search_r1_grpo --steps 6 --extra rollout.n=2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ["gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "sync", "step"]
SMALL = [
    "model.sft_checkpoint=null",
    "trainer.save_freq=0",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.dump_rollouts=false",
    "data.train_batch_size=4",
    "data.val_max_samples=4",
    "rollout.max_turns=2",
    "rollout.max_tokens_per_turn=32",
    "rollout.max_response_length=160",
    "actor.ppo_mini_batch_size=4",
    "actor.micro_batch_size=2",
    "critic.ppo_mini_batch_size=4",
    "critic.micro_batch_size=2",
]


def run(recipe: str, steps: int, workers: int, extra: list[str], workdir: str) -> list[dict]:
    run_dir = os.path.join(workdir, f"w{workers}")
    cmd = [sys.executable, "-m", "rsearch_verl.main", f"+recipe={recipe}", f"trainer.total_steps={steps}"]
    cmd += [*SMALL, f"trainer.n_workers={workers}", f"trainer.run_dir={run_dir}", *extra]
    cmd += [f"data.toy_world.cache_dir={os.path.join(workdir, 'toy')}"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RSEARCH_LOG_LEVEL": "WARNING"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def phase_means(rows: list[dict]) -> dict[str, float]:
    timed = [r for r in rows if r["step"] >= 2 and "timing/step_s" in r]  # step 1 is warm-up
    out = {}
    for phase in PHASES:
        vals = [r[f"timing/{phase}_s"] for r in timed if f"timing/{phase}_s" in r]
        out[phase] = sum(vals) / len(vals) if vals else float("nan")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="search_r1_ppo")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for both runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        base = phase_means(run(args.recipe, args.steps, 1, args.extra, workdir))
        cand = phase_means(run(args.recipe, args.steps, 2, args.extra, workdir))
    print(f"{'phase':<14}{'1 rank (s)':>12}{'2 ranks (s)':>13}")  # noqa: T201
    for phase in PHASES:
        print(f"{phase:<14}{base[phase]:>12.3f}{cand[phase]:>13.3f}")  # noqa: T201
    ratio = base["step"] / cand["step"]
    print(f"recipe {args.recipe}, {args.steps - 1} timed steps: step time 1 rank / 2 ranks = {ratio:.2f}x")  # noqa: T201


if __name__ == "__main__":
    main()
