"""Does the toy world's main job learn, for every RL seed and every world? A grid of real main jobs.

Each cell runs `python -m rsearch_verl.main` (local Ray, the recipe's own BM25 server, the world's cached warm start)
and reads its metrics.jsonl: held-out EM and searches per question before the first update (= the warm start) and
after the last one. The grid is variants x RL seeds (`seed`) x toy worlds (`data.toy_world.seed`); the warm start
has its own seed (model.warm_start_seed), so all RL seeds of a world start from the same cached warm start.

Variants: PPO (search_r1_ppo, the README's main job) with observation masking, the same without masking
(`algorithm.mask_observations=false`, Search-R1's Table 4 ablation), GRPO (search_r1_grpo, rollout.n=4 x 4 prompts:
the same 16 trajectories per step as PPO's 16 prompts) with masking, and PPO trained asynchronously with batches one
update old (`ppo_async1`: split placement, trainer.max_staleness=1; not in the default grid, `--only ppo_async1`),
streaming rollouts (`ppo_stream`, `grpo_stream`: trainer.rollout_mode=streaming at staleness 1, `--only ...`),
REINFORCE++ on PPO's batch without a critic (`rpp`) and Dr.GRPO on GRPO's batch (`drgrpo`). SmolLM2-135M's own
main job (`model=smollm2_135m`: its warm start and CPU sizes, recipes/sizes/smollm2_135m_cpu.yaml) with Search-R1
GRPO (`smollm2_grpo`), JSON tool calls (`smollm2_toolcall`), PPO (`smollm2_ppo`) and GRPO on LoRA adapters
(`smollm2_grpo_lora`), measured on 2 cores: smollm2_grpo about 23 minutes a run, smollm2_toolcall 40, smollm2_grpo_lora
16, plus 9-13 for a world's (and protocol's) first warm start: `--only smollm2_grpo --seeds 3 --worlds 1`.

Per variant: EM gain (after - before) min / median / max, the share of runs that reach the target (the tiny
policy: gain >= +0.25; SmolLM2: gain >= +0.15, 2-hop EM >= 0.25, searches per 2-hop question >= 1.5), searches per
question before -> after (median), EM and searches after RL by question type; then the masking effect (EM after
RL, masked - no-mask, paired by seed and world) and the asynchronous effect (ppo_async1 - ppo) with their spread,
beside the seed effect they are judged against (ppo seed i - seed j in the same world: how far two runs that differ
only in their RL seed land apart). Last line: the worst run's gain for the default recipe (ppo; else the first
variant run). A run that its health checks stop (exit 3; the grid writes no
checkpoints, so the watchdog has nothing to roll back to) is recorded as stopped: a failure, outside the EM spreads.

    .venv/bin/python benchmarks/learning.py                           # 5 RL seeds x 3 worlds x 3 variants
    .venv/bin/python benchmarks/learning.py --seeds 2 --worlds 1 --only ppo --out /tmp/grid
    .venv/bin/python benchmarks/learning.py --jobs 2                  # two runs at a time (1 torch thread each)
    .venv/bin/python benchmarks/learning.py --world hard --seeds 4 --worlds 2 --jobs 2   # the harder world's grid

`--world deep` runs `+recipe=deep_search_grpo` (data=toy_world_deep: 4-6 hop chains, 32 turns) with its context
strategies (docs/long_horizon.md): `--world deep --only deep_drop --seeds 3 --worlds 2`, then
`--world deep --only deep_summary,deep_none --seeds 2 --worlds 1`. `deep_none` starts from deep_drop's warm start (the
same policy; only the rollout's context management differs), so deep_drop's must be built first; deep_summary has its
own (its demonstrations write notes). A deep cell checkpoints every 5 steps and a grid started again resumes it.

`--world hard` runs `data=toy_world_hard` (3-hop questions, near-twin names, passages of three sentences, questions
worded unlike the passages) with the variants PPO, PPO without masking, GRPO, PPO at staleness 1, REINFORCE++ and
Dr.GRPO. Every paired effect (masking, GRPO vs PPO, staleness 1 vs 0, REINFORCE++ vs PPO, Dr.GRPO vs GRPO) is
printed with its spread and a 95 % bootstrap interval of its mean.

Finished cells are kept in `<out>/results.jsonl`: rerunning with the same `--out` resumes the grid. Measured numbers
are in docs/toy_world_learning.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from rsearch_verl.trainer.health import STOP_EXIT_CODE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPLIT1 = ["trainer.placement=split", "trainer.max_staleness=1", "trainer.ray_num_cpus=2"]
VARIANTS = {
    "ppo": ["+recipe=search_r1_ppo"],
    "ppo_nomask": ["+recipe=search_r1_ppo", "algorithm.mask_observations=false"],
    "grpo": ["+recipe=search_r1_grpo", "rollout.n=4", "data.train_batch_size=4"],
    # cross-step asynchronous training (docs/async_training.md): split workers, batches one update old
    "ppo_async1": [
        "+recipe=search_r1_ppo",
        "trainer.placement=split",
        "trainer.max_staleness=1",
        "trainer.ray_num_cpus=2",
    ],  # fmt: skip
    # streaming rollouts (docs/async_training.md): trajectories flow, a step admits whole groups within staleness 1
    "ppo_stream": ["+recipe=search_r1_ppo", *SPLIT1, "trainer.rollout_mode=streaming"],
    "grpo_stream": [
        "+recipe=search_r1_grpo",
        "rollout.n=4",
        "data.train_batch_size=4",
        *SPLIT1,
        "trainer.rollout_mode=streaming",
    ],  # fmt: skip
    # no critic: REINFORCE++ on PPO's batch (16 prompts x 1), Dr.GRPO on GRPO's (4 prompts x 4)
    "rpp": ["+recipe=search_r1_ppo", "algorithm.adv_estimator=reinforce_plus_plus"],
    "drgrpo": ["+recipe=search_r1_drgrpo", "rollout.n=4", "data.train_batch_size=4"],
    # a real pretrained LM (docs/real_models.md): SmolLM2-135M's own main job (its warm start, its CPU sizes)
    "smollm2_grpo": ["model=smollm2_135m", "+recipe=search_r1_grpo"],
    "smollm2_toolcall": ["model=smollm2_135m", "+recipe=search_r1_toolcall_grpo"],
    "smollm2_ppo": ["model=smollm2_135m", "+recipe=search_r1_ppo"],
    "smollm2_grpo_lora": ["model=smollm2_135m", "+recipe=search_r1_grpo", "model.lora_rank=16"],
    # long-horizon agents on the deep world (docs/long_horizon.md): the recipe's strategy, the other one, and none
    "deep_drop": ["+recipe=deep_search_grpo"],
    "deep_summary": ["+recipe=deep_search_grpo", "rollout.context.strategy=summary"],
    "deep_none": ["+recipe=deep_search_grpo", "rollout.context.strategy=none"],
}
# variants that start from another variant's warm start (the same policy, so that only the RL side differs)
SHARED_WARM_START = {"deep_none": "deep_drop"}
QUIET = ["trainer.save_freq=0", "trainer.test_freq=0", "trainer.dump_rollouts=false"]
# --world: the toy world's data group (recipes/data/; the harder one sets its own warm start's gate too), see
# docs/toy_world_learning.md "A harder world"
WORLDS = {"easy": [], "hard": ["data=toy_world_hard"], "deep": []}  # deep: the recipe brings data=toy_world_deep
DEFAULT_VARIANTS = {
    "easy": "ppo,ppo_nomask,grpo",
    "hard": "ppo,ppo_nomask,grpo,ppo_async1,rpp,drgrpo",
    "deep": "deep_drop,deep_summary,deep_none",
}
BOOTSTRAP = 10_000  # resamples of a paired effect's mean
TARGET = 0.25  # held-out EM gain every run of the tiny policy must reach
# SmolLM2's targets: EM gain >= +0.15, 2-hop EM after >= 0.25, searches per 2-hop question after >= 1.5
SMOLLM2_TARGET = {"gain": 0.15, "two_hop_em": 0.25, "two_hop_searches": 1.5}


def reached(run: dict) -> bool:
    """Whether a run reached its variant's targets (the tiny policy's: the gain; SmolLM2's: gain, 2-hop EM and
    2-hop searches)."""
    gain = run["em_after"] - run["em_before"]
    if not run["variant"].startswith("smollm2"):
        return gain >= TARGET
    two_em = run.get("em_after_by_type", {}).get("toy_world_2hop", 0.0)
    two_searches = run.get("searches_after_by_type", {}).get("toy_world_2hop", 0.0)
    t = SMOLLM2_TARGET
    return gain >= t["gain"] and two_em >= t["two_hop_em"] and two_searches >= t["two_hop_searches"]


def run_cell(variant: str, seed: int, world: int, args) -> dict:
    """Run the main job for one cell; return its first and last validation rows and the wall time."""
    run_dir = os.path.join(args.out, f"{variant}-s{seed}-w{world}")
    # a deep world's cell runs for many minutes: it checkpoints and a grid started again resumes it where it stopped
    keep = ["trainer.save_freq=5", "trainer.resume=auto"] if args.world == "deep" else ["trainer.resume=disable"]
    if variant in SHARED_WARM_START:
        keep.append(f"model.sft_checkpoint={warm_start_of(SHARED_WARM_START[variant], world, args)}")
    quiet = [q for q in QUIET if not (args.world == "deep" and q.startswith("trainer.save_freq"))]
    cmd = [sys.executable, "-m", "rsearch_verl.main", *VARIANTS[variant], *quiet, f"trainer.run_dir={run_dir}"]
    cmd += [*WORLDS[args.world], f"seed={seed}", f"data.toy_world.seed={world}", *keep, *args.extra]
    if args.steps is not None:
        cmd.append(f"trainer.total_steps={args.steps}")
    env = dict(os.environ)
    if args.jobs > 1:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, f"{variant}-s{seed}-w{world}.log")  # the job log: follow an hour-long cell
    with open(log_path, "a") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    wall = time.perf_counter() - start
    cell = {"variant": variant, "seed": seed, "world": world}
    if proc.returncode == STOP_EXIT_CODE:  # its own health checks ended the run: an outcome, recorded; the grid goes on
        with open(os.path.join(run_dir, "summary.json")) as f:
            reason = json.load(f)["health"]["stop"]["reason"]
        return {**cell, "stopped": reason, "wall_s": round(wall, 1)}
    if proc.returncode != 0:
        with open(log_path) as log:
            tail = log.read()[-3000:]
        raise RuntimeError(f"{variant} seed {seed} world {world}: main job failed (log {log_path}):\n{tail}")
    return {**cell, **read_run(run_dir), "wall_s": round(wall, 1)}


def warm_start_of(variant: str, world: int, args) -> str:
    """The cached warm start `variant` uses on `world` (it must be built: its own cells run first)."""
    from rsearch_verl.config import load_config
    from rsearch_verl.rollout.protocols import protocol_for
    from rsearch_verl.run_context import RunContext
    from rsearch_verl.toy.warm_start import warm_start_dir
    from rsearch_verl.toy.world_data import toy_world_data

    cfg = load_config([*VARIANTS[variant], *WORLDS[args.world], f"data.toy_world.seed={world}", *args.extra])
    path = warm_start_dir(RunContext(tokenizer_path=toy_world_data(cfg, protocol_for(cfg)).tokenizer_path).apply(cfg))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{variant}'s warm start for world {world} is not built ({path}): run its cells first")
    return path


def _built(variant: str, world: int, args) -> bool:
    """Whether `variant`'s warm start for `world` is cached already (one whose key cannot be found counts as not
    built, so its world runs one cell first). A grid given its policy (`--extra model.sft_checkpoint=DIR`) builds
    none."""
    if any(e.startswith("model.sft_checkpoint=") and e != "model.sft_checkpoint=auto" for e in args.extra):
        return True
    try:
        warm_start_of(variant, world, args)
    except FileNotFoundError:
        return False
    return True


def read_run(run_dir: str) -> dict:
    """Held-out EM and searches per question before the first update and after the last one, and EM after by
    question type (the validation's per-source EM, e.g. toy_world_2hop)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        vals = [row for row in map(json.loads, f) if "val/em" in row]
    before, after = vals[0], vals[-1]
    by_type = {key.split("/")[1]: v for key, v in after.items() if key.startswith("val/") and key.endswith("/em")}
    searches = {k.split("/")[1]: v for k, v in after.items() if k.count("/") == 2 and k.endswith("/searches_mean")}
    return {
        "em_before": before["val/em"],
        "em_after": after["val/em"],
        "searches_before": before["val/searches_mean"],
        "searches_after": after["val/searches_mean"],
        "em_after_by_type": {k: v for k, v in sorted(by_type.items()) if k != "em"},
        "searches_after_by_type": dict(sorted(searches.items())),
    }


def load_done(path: str) -> dict[tuple, dict]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {(r["variant"], r["seed"], r["world"]): r for r in rows}


def spread(values: list[float]) -> str:
    return f"{min(values):+.3f} / {statistics.median(values):+.3f} / {max(values):+.3f}"


def report(rows: list[dict], variants: list[str]) -> list[str]:
    """The table's lines (printed and returned)."""
    lines = [
        f"{'variant':<11} {'runs':>4} {'EM gain min / median / max':>28} {'>= target':>9} {'searches/q':>14}"
        f" {'EM after min / median / max':>28}"
    ]
    stopped = [r for r in rows if r.get("stopped")]  # no trained policy: a failed run, outside the EM spreads
    by_variant = {v: [r for r in rows if r["variant"] == v and not r.get("stopped")] for v in variants}
    for name, runs in by_variant.items():
        if not runs:
            continue
        gains = [r["em_after"] - r["em_before"] for r in runs]
        share = sum(map(reached, runs)) / (len(runs) + sum(r["variant"] == name for r in stopped))
        s_before = statistics.median(r["searches_before"] for r in runs)
        s_after = statistics.median(r["searches_after"] for r in runs)
        searches = f"{s_before:.2f} -> {s_after:.2f}"
        after = spread([r["em_after"] for r in runs]).replace("+", "")
        lines.append(f"{name:<11} {len(runs):>4} {spread(gains):>28} {share:>9.0%} {searches:>14} {after:>28}")
    lines += _by_type(by_variant)
    effects = _paired(by_variant, "ppo", "ppo_nomask", "masking effect (EM after RL, ppo - ppo_nomask")
    effects += _paired(by_variant, "grpo", "ppo", "GRPO vs PPO (EM after RL, grpo - ppo")
    effects += _paired(by_variant, "ppo_async1", "ppo", "asynchronous effect (EM after RL, ppo_async1 - ppo")
    effects += _paired(by_variant, "rpp", "ppo", "REINFORCE++ vs PPO (EM after RL, rpp - ppo")
    effects += _paired(by_variant, "drgrpo", "grpo", "Dr.GRPO vs GRPO (EM after RL, drgrpo - grpo")
    effects += _paired(by_variant, "ppo_stream", "ppo", "streaming vs synchronous PPO (EM after RL, ppo_stream - ppo")
    effects += _paired(
        by_variant, "grpo_stream", "grpo", "streaming vs synchronous GRPO (EM after RL, grpo_stream - grpo"
    )
    effects += _paired(by_variant, "deep_drop", "deep_none", "context management (EM after RL, deep_drop - deep_none")
    effects += _paired(by_variant, "deep_summary", "deep_none", "notes (EM after RL, deep_summary - deep_none")
    lines += effects + (_seed_effect(by_variant, "ppo") if effects else [])
    lines += [f"stopped: {r['variant']} seed {r['seed']} world {r['world']}: {r['stopped']}" for r in stopped]
    head = by_variant.get("ppo") or next((r for r in by_variant.values() if r), None)
    if head is None:
        return [*lines, "no run finished"]
    worst = min(head, key=lambda r: r["em_after"] - r["em_before"])
    worst = next((r for r in stopped if r["variant"] == worst["variant"]), worst)
    gain = "stopped" if worst.get("stopped") else f"EM gain {worst['em_after'] - worst['em_before']:+.3f}"
    lines.append(
        f"worst run of {worst['variant']}: {gain} (seed {worst['seed']}, world {worst['world']}; target >= "
        f"+{SMOLLM2_TARGET['gain'] if worst['variant'].startswith('smollm2') else TARGET})"
    )
    return lines


def _by_type(by_variant: dict) -> list[str]:
    """EM (and searches per question, where recorded) after RL by question type: min / median / max over each
    variant's runs (rows that record it)."""
    lines = []
    for name, runs in by_variant.items():
        for key, what, fmt in (("em_after_by_type", "EM", "{:.2f}"), ("searches_after_by_type", "searches", "{:.2f}")):
            by_type: dict[str, list[float]] = {}
            for run in runs:
                for kind, value in run.get(key, {}).items():
                    by_type.setdefault(kind, []).append(value)
            if by_type:
                cells = ", ".join(
                    f"{kind} " + " / ".join(fmt.format(x) for x in (min(v), statistics.median(v), max(v)))
                    for kind, v in sorted(by_type.items())
                )
                lines.append(f"  {name}: {what} after by question type (min / median / max): {cells}")
    return lines


def deciles(values: list[float]) -> str:
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return f"{cuts[0]:+.3f} / {cuts[8]:+.3f}"


def _paired(by_variant: dict, a: str, b: str, title: str) -> list[str]:
    """EM after RL of variant a minus b, paired by seed and world (one line, or none without pairs)."""
    other = {(r["seed"], r["world"]): r for r in by_variant.get(b, [])}
    diffs = [r["em_after"] - other[(r["seed"], r["world"])]["em_after"] for r in by_variant.get(a, [])
             if (r["seed"], r["world"]) in other]  # fmt: skip
    if not diffs:
        return []
    tail = f"; p10 / p90 {deciles(diffs)}" if len(diffs) > 1 else ""
    low, high = bootstrap_ci(diffs)
    tail += f"; mean {statistics.fmean(diffs):+.3f}, 95 % bootstrap CI [{low:+.3f}, {high:+.3f}]"
    return [f"{title}, {len(diffs)} pairs): {spread(diffs)}{tail}"]


def bootstrap_ci(diffs: list[float], level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of paired differences (resampling the pairs; seeded)."""
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(BOOTSTRAP))
    cut = (1 - level) / 2
    return means[int(cut * (BOOTSTRAP - 1))], means[int((1 - cut) * (BOOTSTRAP - 1))]


def _seed_effect(by_variant: dict, variant: str) -> list[str]:
    """What a paired effect is judged against: EM after RL of one seed minus another seed's, same variant and world
    (every ordered pair), i.e. how far two runs that differ only in their RL seed land apart."""
    runs = by_variant.get(variant, [])
    diffs = [a["em_after"] - b["em_after"] for a in runs for b in runs if a["world"] == b["world"] and a is not b]
    if len(diffs) < 2:
        return []
    title = f"seed effect (EM after RL, {variant} seed i - seed j, same world, {len(diffs)} pairs)"
    return [f"{title}: {spread(diffs)}; p10 / p90 {deciles(diffs)}"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="RL seeds 1..N")
    parser.add_argument("--worlds", type=int, default=3, help="toy world seeds 0..M-1")
    parser.add_argument("--world", choices=sorted(WORLDS), default="easy", help="easy: the default toy world")
    known = ",".join(VARIANTS)
    parser.add_argument("--only", default=None, help=f"comma-separated variants of {known} (default: the world's)")
    parser.add_argument("--steps", type=int, default=None, help="trainer.total_steps (default: the trainer group's)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each then uses one torch thread)")
    parser.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every run")
    parser.add_argument("--out", default=None, help="directory for run dirs and results.jsonl (default: a temp dir)")
    args = parser.parse_args(argv)
    args.out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="rsearch-learning-"))
    os.makedirs(args.out, exist_ok=True)
    variants = (args.only or DEFAULT_VARIANTS[args.world]).split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    results_path = os.path.join(args.out, "results.jsonl")
    done = load_done(results_path)
    # worlds outermost: the first run of a world builds its warm start, which every later run of it reuses
    cells = [(v, s, w) for w in range(args.worlds) for s in range(1, args.seeds + 1) for v in variants]
    for row in run_cells([c for c in cells if c not in done], args):
        done[(row["variant"], row["seed"], row["world"])] = _record(row, results_path)
    rows = [done[c] for c in cells]
    for line in report(rows, variants):
        print(line)  # noqa: T201 - the benchmark's table
    return rows


def run_cells(todo: list[tuple], args) -> Iterator[dict]:
    """Run the cells `args.jobs` at a time, yielding each row as it finishes (a crash later loses no finished cell).
    A world's first cell builds its warm start, so the world's other cells wait for it (concurrent runs must not build
    the same warm start twice); other worlds' cells, and those of a world whose warm starts are all built, run
    meanwhile."""
    firsts: dict[int, tuple] = {}
    for cell in todo:
        firsts.setdefault(cell[2], cell)
    starts = {(SHARED_WARM_START.get(v, v), w) for v, _, w in todo}  # a warm start per (variant, world), not seed
    ready = {w for w in firsts if all(_built(v, sw, args) for v, sw in starts if sw == w)}
    firsts = {w: c for w, c in firsts.items() if w not in ready}
    later = {w: [c for c in todo if c[2] == w and c != first] for w, first in firsts.items()}
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        start = [*firsts.values(), *(c for c in todo if c[2] in ready)]
        pending = {pool.submit(run_cell, *c, args): c for c in start}
        while pending:
            finished, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                cell = pending.pop(future)
                yield future.result()
                if firsts.get(cell[2]) == cell:  # the world's warm start is cached now
                    pending |= {pool.submit(run_cell, *c, args): c for c in later.pop(cell[2])}


def _record(row: dict, path: str) -> dict:
    logging_line = json.dumps(row)
    with open(path, "a") as f:
        f.write(logging_line + "\n")
    print(f"# {logging_line}", flush=True)  # noqa: T201 - progress
    return row


if __name__ == "__main__":
    main()
