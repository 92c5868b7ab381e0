"""The real-model lane at full speed: SmolLM2-135M's main job as it was (the HF engine, one torch thread in the
actor's process), with the HF engine on every core, and on its default (vLLM on CPU, every core).

Workload: `model=smollm2_135m +recipe=search_r1_grpo` (its cached warm start, its CPU sizes: 20 trajectories a step),
colocated on 2 CPUs, the toy world's own BM25 server; the same seed, so every arm starts from the same weights and
the same first prompts. Arms (`ARMS`): `hf-1t` = rollout.engine=hf trainer.cpu_threads=ray (the lane before: Ray gives
the actor's process one thread), `hf` = rollout.engine=hf with the model group's threads, `vllm` = the model group's
defaults. Runs alternate arms (hf-1t, hf, vllm, hf-1t, ...) for `--rounds` rounds; per run the means over steps after
`--skip` (the first step warms up: vLLM compiles and allocates its KV cache there) of the step time and its phases
(`timing/*_s`) and the engine-vs-actor log-prob gap (`rollout/logprob_abs_diff_mean`, the compute dtype's mismatch).
The table shows, per arm, the median over rounds with min..max; the ratios are paired with the same round's hf-1t and
hf runs. Last line: vllm / hf-1t median step time `N.NNx` (the default against the lane before), then vllm / hf (the
engine alone).

    .venv/bin/python benchmarks/engines.py                    # 3 rounds x 3 arms x 4 steps, ~40 min on 2 cores
    .venv/bin/python benchmarks/engines.py --rounds 1 --steps 3 --arms hf vllm model.dtype=float32
    .venv/bin/python benchmarks/engines.py --report /tmp/engines   # the table of a finished run again

Never time it beside another job on the same cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from async_training import spread  # noqa: E402

logger = logging.getLogger("engines")
# arm -> its overrides on top of BASE (the model group's defaults: vllm, trainer.cpu_threads=auto)
ARMS = {
    "hf-1t": ["rollout.engine=hf", "trainer.cpu_threads=ray"],
    "hf": ["rollout.engine=hf"],
    "vllm": ["rollout.engine=vllm"],
}
PHASES = ("step", "gen", "old_log_prob", "ref", "update_actor", "sync")
BASE = [
    "model=smollm2_135m",
    "+recipe=search_r1_grpo",
    "trainer.save_freq=0",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.dump_rollouts=false",
    "trainer.resume=disable",
]


def run(engine: str, args, out: str, tag: str) -> dict:
    """One main job of arm `engine`; its per-step means over the timed steps."""
    run_dir = os.path.join(out, f"{engine}-{tag}")
    cmd = [sys.executable, "-m", "rsearch_verl.main", *BASE, *ARMS[engine]]
    cmd += [f"trainer.total_steps={args.steps}", f"trainer.run_dir={run_dir}", f"seed={args.seed}", *args.extra]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    with open(os.path.join(out, f"{engine}-{tag}.log"), "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} ({tag}): main job failed, see {log.name}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "timing/step_s" in r and r["step"] > args.skip]
    logger.info("%s (%s): %.0f s", engine, tag, time.perf_counter() - start)
    out_row = {"engine": engine}
    for phase in PHASES:
        values = [r[f"timing/{phase}_s"] for r in rows if f"timing/{phase}_s" in r]
        out_row[phase] = statistics.mean(values) if values else float("nan")
    gaps = [r["rollout/logprob_abs_diff_mean"] for r in rows if "rollout/logprob_abs_diff_mean" in r]
    out_row["gap"] = statistics.mean(gaps) if gaps else float("nan")
    out_row["searches"] = statistics.mean(r["rollout/searches_mean"] for r in rows)
    return out_row


def report(results: list[dict]) -> tuple[float | None, float | None]:
    """Per arm: each phase's median (min..max) over rounds; its step time paired with the round's hf-1t and hf runs.
    Returns the median paired ratios vllm / hf-1t and vllm / hf."""
    rounds = sorted({r["round"] for r in results})
    by = {(r["engine"], r["round"]): r for r in results}
    print(f"{len(rounds)} rounds; seconds per step, median (min..max) over rounds")  # noqa: T201
    print(f"{'arm':<7}" + "".join(f"{p:>22}" for p in (*PHASES, "gap"))  # noqa: T201
          + f"{'searches':>10}{'vs hf-1t (paired)':>24}{'vs hf (paired)':>24}")  # fmt: skip
    medians = {}
    for engine in ARMS:
        rows = [by[(engine, k)] for k in rounds if (engine, k) in by]
        if not rows:
            continue
        rel = {}
        for base in ("hf-1t", "hf"):
            both = [k for k in rounds if (engine, k) in by and (base, k) in by]
            paired = [by[(engine, k)]["step"] / by[(base, k)]["step"] for k in both]
            rel[base] = spread(paired) if paired else "-"
            if engine == "vllm" and paired:
                medians[base] = statistics.median(paired)
        cells = "".join(f"{spread([r[p] for r in rows]):>22}" for p in PHASES)
        gap = spread([r["gap"] for r in rows])
        searches = statistics.mean(r["searches"] for r in rows)
        print(f"{engine:<7}{cells}{gap:>22}{searches:>10.2f}{rel['hf-1t']:>24}{rel['hf']:>24}")  # noqa: T201
    return medians.get("hf-1t"), medians.get("hf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="trainer.total_steps of each run")
    parser.add_argument("--skip", type=int, default=1, help="warm-up steps not timed")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--report", default=None, help="print the table of a finished run dir (its results.jsonl)")
    parser.add_argument("extra", nargs="*", help="more Hydra overrides for every run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.report:
        with open(os.path.join(args.report, "results.jsonl")) as f:
            ratios = report([json.loads(line) for line in f])
    else:
        out = args.out or tempfile.mkdtemp(prefix="engines-")
        os.makedirs(out, exist_ok=True)
        results = []
        for k in range(args.rounds):
            for engine in args.arms:
                row = {**run(engine, args, out, f"r{k}"), "round": k}
                results.append(row)
                with open(os.path.join(out, "results.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
        ratios = report(results)
    before, engine_only = ratios
    if before is not None or engine_only is not None:
        text = [f"{x:.2f}x" if x is not None else "-" for x in (before, engine_only)]
        print(f"vllm / hf-1t median step time {text[0]} (vllm / hf {text[1]})")  # noqa: T201


if __name__ == "__main__":
    main()
