"""Streaming rollouts against batch rollouts: trajectories per second of the same main job, three modes in paired
rounds, 2 CPUs (docs/async_training.md).

Modes (all `trainer.placement=split`: one actor rank and one rollout worker, a 1-CPU Ray bundle and 1 torch thread
each):
    sync      trainer.max_staleness=0: generate a batch, then train on it
    batch1    trainer.max_staleness=1, rollout_mode=batch: the next batch generates while the actor trains
    stream1   trainer.max_staleness=1, rollout_mode=streaming, staleness_rule=admission (the default): trajectories
              flow, a group starts while (k + 1) x B groups started and not trained leave room, a step trains the
              oldest finished whole groups and waits for none
    stream2   the same at staleness 2
    stream1-ot  stream1 with trainer.staleness_rule=oldest_token: every admitted token at most 1 update old, a step
              waits for its due groups (the rule before `admission`)
    stream4   the same at staleness 4 (oldest_token): how far the bound sets the tail's pace (not in the default modes)
    stream1-np  stream1 without the log-probs the actor computes while a step waits (trainer.prefetch_log_probs=off;
              not in the default modes: `--modes ... stream1-np`)
Workloads:
    readme    the README's job (search_r1_ppo on the toy world, its cached warm start): short trajectories
    tail      +recipe=search_r1_grpo (GRPO 4 x 8, up to 17 turns) with a scripted heavy-tailed policy: 1 to 17 turns
              a trajectory, P(searches >= s) = 1 / (s + 1) (rsearch_verl/testing/turn_script.py); the actor packs
              its micro-batches by a token budget (`PACKED`), in every mode
    deep      the same recipe with its own warm-started policy on the deep world (its cached warm start)
The turn distribution of each workload is printed.
Every search goes through a proxy that waits `--latency-s` +- `--jitter-s` (rsearch_verl/testing/latency_proxy.py)
in front of the world's own BM25 server, the order of a web search API. Everything else is the real main job.

Per run, over the steps after `--skip` (the pipelines filling): trajectories per second (trajectories trained per
step / step time), rollout idle (timing/rollout_idle_s over the wall time), actor idle, the mean turns of the trained
trajectories and the turn rate against sync (trajectories per second x turns: a stream trains a long group when it
comes due, so its timed steps can hold fewer or more long groups than the loader's order gives sync), the admitted
staleness (streaming: the head lag, updates between the trained weights and a group's oldest token; its mean and
max over the run's steps), and for streaming the turn bias (mean turns of admitted / of all finished trajectories,
`stream/turn_bias`).
Rounds run the modes in turn; speed-ups are paired with the same round's sync and batch1 runs. The last line, for the
last workload run (tail by default): streaming (admission) / synchronous and streaming / batch at staleness 1. Draws
of seeds and worlds: `--seed N` and a trailing override `data.toy_world.seed=M`, one invocation each.

    .venv/bin/python benchmarks/streaming.py                                # both workloads, 2 rounds
    .venv/bin/python benchmarks/streaming.py --workloads deep --rounds 3 --steps 10
    .venv/bin/python benchmarks/streaming.py --report DIR                   # the tables of a finished run again

readme and deep need their warm starts in the cache (a first run of the recipe builds them: ~10 min for readme).
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

from async_training import add_run_args, spread, toy_retriever

from rsearch_verl.testing.latency_proxy import latency_proxy, serve
from rsearch_verl.testing.turn_script import heavy_tail_env

logger = logging.getLogger("streaming")
MODES = {
    "sync": ["trainer.max_staleness=0"],
    "batch1": ["trainer.max_staleness=1"],
    "stream1": ["trainer.max_staleness=1", "trainer.rollout_mode=streaming"],
    "stream2": ["trainer.max_staleness=2", "trainer.rollout_mode=streaming"],
    # a wider bound: how far the tail's pace is the bound's (docs/async_training.md, "Streaming, measured")
    "stream4": ["trainer.max_staleness=4", "trainer.rollout_mode=streaming", "trainer.staleness_rule=oldest_token"],
    # the strict rule: every admitted group's oldest token at most 1 update behind (steps wait for due groups)
    "stream1-ot": ["trainer.max_staleness=1", "trainer.rollout_mode=streaming", "trainer.staleness_rule=oldest_token"],
    # stream1 as it was before the actor prefetched log-probs while a step waits (trainer/prefetch.py)
    "stream1-np": ["trainer.max_staleness=1", "trainer.rollout_mode=streaming", "trainer.prefetch_log_probs=off"],
}
PACKED = ["actor.use_remove_padding=true", "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=4096"]
WORKLOADS = {
    "readme": ["+recipe=search_r1_ppo"],
    # Search-R1 GRPO (4 prompts x 8) driven by a scripted heavy tail: 0 to 16 searches a question, P(>= s) = 1 / (s + 1)
    # (rsearch_verl/testing/turn_script.py), one growing sequence (the script counts its searches in the context, so
    # no folding); the policy's weights do not matter, so no warm start
    "tail": [
        "+recipe=search_r1_grpo",
        "rollout.n=8",
        "data.train_batch_size=4",
        "rollout.max_turns=17",
        "retriever.topk=1",
        "rollout.max_obs_length=48",
        "rollout.max_response_length=1400",
        "model.sft_checkpoint=null",
        "trainer.watchdog.enable=false",  # the scripted lengths swing by design: length_blowup would stop the run
        # lengths from ~100 to ~1400 tokens in one batch: padded micro-batches pay every row at the batch's longest
        # length, so the actor packs (docs/lora_and_packing.md), as a user with such a tail would, in every mode
        *PACKED,
    ],
    # 4 prompts x 8 samples a step keeps a CPU step near the readme job's length
    "deep": ["+recipe=deep_search_grpo", "data.train_batch_size=4"],
}
COMMON = ["trainer.placement=split", "trainer.n_workers=1", "trainer.ray_num_cpus=2", "trainer.save_freq=0",
          "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.dump_rollouts=false",
          "trainer.resume=disable"]  # fmt: skip


def run(workload: str, mode: str, args, url: str, out: str, tag: str) -> dict:
    run_dir = os.path.join(out, f"{workload}-{mode}-{tag}")
    cmd = [sys.executable, "-m", "rsearch_verl.main", *WORKLOADS[workload], *COMMON, *MODES[mode]]
    cmd += [f"trainer.total_steps={args.steps}", f"trainer.run_dir={run_dir}", f"retriever.url={url}"]
    cmd += [f"data.toy_world.cache_dir={args.cache}", f"seed={args.seed}", *args.extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    if workload == "tail":
        env.update(heavy_tail_env(max_searches=args.max_searches))
    start = time.perf_counter()
    with open(run_dir + ".log", "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{workload} {mode}: main job failed, log {run_dir}.log")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "timing/step_s" in r and r["step"] > args.skip]
    logger.info("%s %s (%s): %.0f s", workload, mode, tag, time.perf_counter() - start)
    wall = sum(r["timing/step_s"] for r in rows)
    trajectories = sum(r["rollout/trajectories"] for r in rows)
    return {
        "workload": workload, "mode": mode,
        "traj_per_s": trajectories / wall,
        "step_s": wall / len(rows),
        "rollout_idle": sum(r["timing/rollout_idle_s"] for r in rows) / wall,
        "actor_idle": sum(r["timing/actor_idle_s"] for r in rows) / wall,
        "staleness_max": max(r.get("stream/lag_head_max", r["async/staleness_max"]) for r in rows),
        "lag_head_mean": statistics.mean(r.get("stream/lag_head_mean", r["async/staleness_mean"]) for r in rows),
        "turns_mean": statistics.mean(r["rollout/turns_mean"] for r in rows),
        "turns_max": max(r["rollout/turns_max"] for r in rows),
        "turns_p90": statistics.mean(r["rollout/turns_p90"] for r in rows),
        "turn_bias": rows[-1].get("stream/turn_bias", 1.0),
        "dropped": sum(r.get("stream/dropped_stale", 0.0) + r.get("stream/aborted", 0.0) for r in rows),
    }  # fmt: skip


def report(results: list[dict]) -> tuple[float, float] | None:
    """One table per workload; returns (stream1 / sync, stream1 / batch1) of the last workload, paired by round."""
    last = None
    for workload in dict.fromkeys(r["workload"] for r in results):
        rows = [r for r in results if r["workload"] == workload]
        by = {(r["mode"], r["round"]): r for r in rows}
        turns = [statistics.median(r[k] for r in rows) for k in ("turns_mean", "turns_p90")]
        most = max(r["turns_max"] for r in rows)
        print(f"\n{workload}: turns per trajectory mean {turns[0]:.1f}, p90 {turns[1]:.1f}, max {most:.0f}")
        print(
            "mode        runs  traj/s median (min..max)  vs sync (paired)  vs batch1 (paired)  rollout idle (min..max)"
            "  actor idle  turns  turns/s vs sync  turns/s vs batch1  lag mean  lag max  turn bias  dropped"
        )
        ratios = {}
        for mode in MODES:
            runs = [r for r in rows if r["mode"] == mode]
            if runs:
                ratios[mode] = _mode_row(mode, runs, by)
        if "stream1" in ratios:
            last = (ratios["stream1"].get("sync", float("nan")), ratios["stream1"].get("batch1", float("nan")))
    return last


def _mode_row(mode: str, runs: list[dict], by: dict) -> dict[str, float]:
    """Print one mode's row; return its median ratios to sync and batch1. The turn rate (trajectories per second x
    their mean turns) does not depend on which trajectories a run's timed steps happened to train: a stream trains a
    long group when it comes due, so a short window can hold fewer or more of them than the loader's order."""
    vs = {base: [r["traj_per_s"] / by[(base, r["round"])]["traj_per_s"] for r in runs if (base, r["round"]) in by]
          for base in ("sync", "batch1")}  # fmt: skip
    turn_rate, turn_batch = ([r["traj_per_s"] * r["turns_mean"] / (s["traj_per_s"] * s["turns_mean"]) for r in runs
                              if (s := by.get((base, r["round"])))] for base in ("sync", "batch1"))  # fmt: skip
    idle = [r["rollout_idle"] for r in runs]
    cells = [f"{mode:<10}", f"{len(runs):>4}", f"{spread([r['traj_per_s'] for r in runs]):>24}",
             f"{spread(vs['sync']) if vs['sync'] else '-':>17}",
             f"{spread(vs['batch1']) if vs['batch1'] else '-':>19}",
             f"{statistics.median(idle):>9.0%} ({min(idle):.0%}..{max(idle):.0%})",
             f"{statistics.median(r['actor_idle'] for r in runs):>10.0%}",
             f"{statistics.median(r['turns_mean'] for r in runs):>5.1f}",
             f"{spread(turn_rate) if turn_rate else '-':>17}",
             f"{spread(turn_batch) if turn_batch else '-':>18}",
             f"{statistics.median(r.get('lag_head_mean', 0.0) for r in runs):>8.2f}",
             f"{max(r['staleness_max'] for r in runs):>7.0f}",
             f"{statistics.median(r['turn_bias'] for r in runs):>10.2f}",
             f"{sum(r['dropped'] for r in runs):>8.0f}"]  # fmt: skip
    print("  ".join(cells))
    return {b: statistics.median(v) for b, v in vs.items() if v}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["readme", "tail"], choices=list(WORKLOADS))
    parser.add_argument("--max-searches", type=int, default=16, help="the tail workload's longest trajectories")
    parser.add_argument("--modes", nargs="+", default=["sync", "batch1", "stream1", "stream2", "stream1-ot"],
                        choices=list(MODES))  # fmt: skip
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2, help="steps left out of the means (pipelines filling)")
    parser.add_argument("--rounds", type=int, default=2)
    add_run_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the proxy's client logs every search
    if args.report:
        with open(os.path.join(args.report, "results.jsonl")) as f:
            _print_last(report([json.loads(line) for line in f]))
        return
    out = args.out or tempfile.mkdtemp(prefix="streaming_")
    os.makedirs(out, exist_ok=True)
    results = []
    for workload in args.workloads:
        log = os.path.join(out, f"retriever-{workload}.log")
        with toy_retriever(args.cache, log, (*WORKLOADS[workload], *args.extra)) as upstream:  # the run's world
            srv, url = serve(latency_proxy(upstream, args.latency_s, args.jitter_s, seed=args.seed))
            try:
                for i in range(args.rounds):
                    for mode in args.modes:
                        results.append({**run(workload, mode, args, url, out, f"r{i}"), "round": i})
                        with open(os.path.join(out, "results.jsonl"), "w") as f:
                            f.writelines(json.dumps(r) + "\n" for r in results)
            finally:
                srv.should_exit = True
    print(f"{args.steps} steps (means over steps {args.skip + 1}..{args.steps}), search latency {args.latency_s} +- "
          f"{args.jitter_s} s, split placement: 1 actor + 1 rollout worker, 1 CPU each; runs in {out}")  # fmt: skip
    _print_last(report(results))


def _print_last(last: tuple[float, float] | None) -> None:
    if last is None:
        print("no streaming run")
        return
    print(f"streaming / synchronous {last[0]:.2f}x, streaming / batch {last[1]:.2f}x")


if __name__ == "__main__":
    main()
