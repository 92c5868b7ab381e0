"""Cross-step asynchronous training: step time at trainer.max_staleness 0 / 1 / 2 on the same steps, 2 CPUs.

Workload: the README's main job (search_r1_ppo on the toy world, from its cached warm start) with
`trainer.placement=split`: one actor rank and one rollout worker, each a 1-CPU Ray bundle running 1 torch thread.
The toy world's BM25 answers in milliseconds; a proxy in front of it (rsearch_verl/testing/latency_proxy.py) gives
every search `--latency-s` +- `--jitter-s`, the order of a web search API, so that generating a batch (turns of
decoding plus searches) and training on it take comparable time. Everything else is the real main job: the same
prompts in the same order, the same seeds, for every staleness.

Per run, over the steady-state steps (after `--skip` steps: the first batch cannot overlap anything):
    step_s     mean timing/step_s (waiting for the batch + training it)
    gen_s      the synchronous run's own generation time per step (timing/gen_s), train_s = step_s - gen_s
    ideal_s    mean over steps of max(gen_s, train_s) of the synchronous run: the step time of a perfect overlap
    idle       timing/rollout_idle_s and timing/actor_idle_s per step
Runs alternate staleness (0, 1, 2, 0, 1, 2, ...) for `--repeats` rounds; the table shows the median over rounds with
min..max; speed-up and distance to the ideal are paired with the synchronous run of the same round (a machine whose
load changes between rounds affects both alike). The last line: the speed-up at staleness 1 over synchronous and its
step time against the ideal overlap. `--report DIR` prints the table of a finished run again.

    .venv/bin/python benchmarks/async_training.py                       # 3 x 2 runs of 12 steps, ~15 min
    .venv/bin/python benchmarks/async_training.py --steps 20 --repeats 3 --latency-s 1.5

The learning side (does staleness 1 still learn?) is benchmarks/learning.py --only ppo_async1.
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
sys.path.insert(0, ROOT)

from rsearch_verl.config import load_config  # noqa: E402
from rsearch_verl.search.service import RetrieverService  # noqa: E402
from rsearch_verl.testing.latency_proxy import latency_proxy, serve  # noqa: E402

logger = logging.getLogger("async_training")
BASE = [
    "+recipe=search_r1_ppo",
    "trainer.placement=split",
    "trainer.n_workers=1",
    "trainer.ray_num_cpus=2",  # one bundle for the actor, one for the rollout worker
    "trainer.save_freq=0",
    "trainer.test_freq=0",
    "trainer.dump_rollouts=false",
    "trainer.resume=disable",
]


def toy_retriever(cache: str, log_path: str, overrides: tuple[str, ...] = (BASE[0],)) -> RetrieverService:
    """The toy world's own BM25 server for the run `overrides` configure, started as a training run starts it (the
    world is built if needed)."""
    from rsearch_verl.rollout.protocols import protocol_for
    from rsearch_verl.trainer.data_sources import load_run_data

    cfg = load_config([*overrides, f"data.toy_world.cache_dir={cache}"])
    data = load_run_data(cfg, protocol_for(cfg))
    return RetrieverService(cfg.retriever, data.corpus, data.index_dir, log_path=log_path)


def run(staleness: int, args, url: str, out: str, tag: str) -> dict:
    run_dir = os.path.join(out, f"k{staleness}-{tag}")
    cmd = [sys.executable, "-m", "rsearch_verl.main", *BASE, f"trainer.max_staleness={staleness}"]
    cmd += [f"trainer.total_steps={args.steps}", f"trainer.run_dir={run_dir}", f"retriever.url={url}"]
    cmd += [f"data.toy_world.cache_dir={args.cache}", f"seed={args.seed}", *args.extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"staleness {staleness}: main job failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "timing/step_s" in r and r["step"] > args.skip]
    logger.info("staleness %d (%s): %.0f s", staleness, tag, time.perf_counter() - start)
    gen = [r["timing/gen_s"] for r in rows]
    train = [r["timing/step_s"] - r["timing/gen_s"] for r in rows]
    return {
        "staleness": staleness,
        "step_s": statistics.mean(r["timing/step_s"] for r in rows),
        "gen_s": statistics.mean(gen),
        "train_s": statistics.mean(train),
        "ideal_s": statistics.mean(max(g, t) for g, t in zip(gen, train, strict=True)),
        "rollout_s": statistics.mean(r["timing/rollout_s"] for r in rows),
        "rollout_idle_s": statistics.mean(r["timing/rollout_idle_s"] for r in rows),
        "actor_idle_s": statistics.mean(r["timing/actor_idle_s"] for r in rows),
        "staleness_max": max(r["async/staleness_max"] for r in rows),
        "searches": statistics.mean(r["rollout/searches_mean"] for r in rows),
    }


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """The options every main-job timing benchmark takes: search latency, seed, cache, output, report, overrides."""
    parser.add_argument("--latency-s", type=float, default=1.0)
    parser.add_argument("--jitter-s", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/rsearch_verl/toy_world"))
    parser.add_argument("--out", default=None)
    parser.add_argument("--report", default=None, help="print the table(s) of a finished run dir (its results.jsonl)")
    parser.add_argument("extra", nargs="*", help="more Hydra overrides for every run")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}..{max(values):.2f})"


def _pct_spread(values: list[float]) -> str:
    return f"{statistics.median(values):+.0%} ({min(values):+.0%}..{max(values):+.0%})"


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(results: list[dict], levels: list[int]) -> None:
    """Per staleness: step time, and -- paired with the synchronous run of the same round, so that load changing
    between rounds cancels -- the speed-up and the distance to that run's ideal overlap."""
    sync = {r["round"]: r for r in results if r["staleness"] == 0}
    phases = {k: spread([r[k] for r in sync.values()]) for k in ("gen_s", "train_s", "ideal_s")}
    print(f"synchronous phases per step: gen {phases['gen_s']} s, train {phases['train_s']} s, "
          f"ideal overlap max(gen, train) {phases['ideal_s']} s")  # fmt: skip
    head = ["staleness", "runs", "step_s median (min..max)", "speed-up (paired)", "vs ideal (paired)"]
    print("  ".join(head + ["rollout idle s", "actor idle s", "max stale", "searches/q"]))
    paired = {}
    for k in levels:
        rows = [r for r in results if r["staleness"] == k]
        speed = [sync[r["round"]]["step_s"] / r["step_s"] for r in rows]
        ideal = [r["step_s"] / sync[r["round"]]["ideal_s"] - 1 for r in rows]
        paired[k] = (statistics.median(speed), statistics.median(ideal))
        cells = [f"{k:>9}", f"{len(rows):>4}", f"{spread([r['step_s'] for r in rows]):>24}", f"{spread(speed):>17}",
                 f"{_pct_spread(ideal):>17}", f"{_median(rows, 'rollout_idle_s'):>14.2f}",
                 f"{_median(rows, 'actor_idle_s'):>12.2f}", f"{max(r['staleness_max'] for r in rows):>9.0f}",
                 f"{_median(rows, 'searches'):>10.2f}"]  # fmt: skip
        print("  ".join(cells))
    speed, ideal = paired.get(1, paired[max(paired)])
    print(f"staleness 1: {speed:.2f}x faster than synchronous (median of rounds), step time {ideal:+.0%} vs the ideal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="steps left out of the means (pipeline filling)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2])
    add_run_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.report:
        with open(os.path.join(args.report, "results.jsonl")) as f:
            results = [json.loads(line) for line in f]
        report(results, sorted({r["staleness"] for r in results}))
        return
    out = args.out or tempfile.mkdtemp(prefix="async_training_")
    os.makedirs(out, exist_ok=True)
    with toy_retriever(args.cache, os.path.join(out, "retriever.log")) as upstream:
        srv, url = serve(latency_proxy(upstream, args.latency_s, args.jitter_s, seed=args.seed))
        try:
            rounds = [(i, k) for i in range(args.repeats) for k in args.levels]
            results = [{**run(k, args, url, out, f"r{i}"), "round": i} for i, k in rounds]
        finally:
            srv.should_exit = True
    with open(os.path.join(out, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in results)
    print(f"{args.steps} steps (means over steps {args.skip + 1}..{args.steps}), search latency {args.latency_s} +- "
          f"{args.jitter_s} s, split placement: 1 actor + 1 rollout worker, 1 CPU each; runs in {out}")  # fmt: skip
    report(results, args.levels)


if __name__ == "__main__":
    main()
