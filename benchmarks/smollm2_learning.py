"""Does a real pretrained LM (SmolLM2-135M-Instruct, `model=smollm2_135m`) learn to search on the toy world? Measured.

Three stages, each measured with the same skill probe (rsearch_verl/warm_start.py `SkillProbe`: the real agent loop
and HF engine on questions of a held-out practice world, temperature 1): the share of trajectories that search, the
EM of those that do, the EM of those that do not.

  1. zero-shot: the model as shipped, prompted through its own chat template.
  2. warm start (skipped with --sft-demos 0): SFT on toy-world demonstrations in the recipe's protocol
     (rsearch_verl/data/toy_demos.py, practice sub-worlds, a share answering from "memory"), rendered through the
     model's chat template, as rsearch_verl/sft.py trains them.
  3. RL: the recipe's main job (`python -m rsearch_verl.main`, local Ray, the recipe's own BM25 server) from the warm
     start for --rl-steps steps; its own validation on the held-out toy-world questions before the first update and
     after the last (val/em by question kind, val/searches_mean), and per step rollout/searches_mean, reward/mean
     and the correct trajectories by question kind (1-hop / 2-hop, from the run's rollout dumps).

Prints a table and a last line: searches per trajectory and EM through the stages. CPU-heavy: one RL step of 8
trajectories is 1-6 minutes on 2 shared cores (10 steps: 16-37 min). Measured stages are kept in
`<out>/probes.jsonl` (and the warm start in `<out>/warm_start`): a rerun with the same --out goes straight to what
is left. Measured numbers are in docs/real_models.md.

    .venv/bin/python benchmarks/smollm2_learning.py --out /tmp/smol                      # Search-R1 GRPO
    .venv/bin/python benchmarks/smollm2_learning.py --recipe search_r1_toolcall_grpo --out /tmp/smol_tc
    .venv/bin/python benchmarks/smollm2_learning.py --sft-demos 0 --rl-steps 4            # no warm start
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import logging
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RL = [
    "data.train_batch_size=2",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=8",
    "actor.micro_batch_size=2",
    "data.val_batch_size=16",
    "trainer.save_freq=0",
    "trainer.test_freq=0",
]
SIZES = ["rollout.max_turns=3", "rollout.max_response_length=320"]
# a turn's token cap: a Search-R1 turn (<think> … </think> <search> q </search>) fits in 48 SmolLM2 tokens; a JSON
# tool call with its <think> is ~50-60, and at 48 every call was cut before </tool_call> (so no search ever ran)
TURN_TOKENS = {"search_r1_grpo": 48, "search_r1_toolcall_grpo": 96}


def sizes(recipe: str) -> list[str]:
    return [*SIZES, f"rollout.max_tokens_per_turn={TURN_TOKENS[recipe]}"]


def probe_row(stage: str, probe) -> dict:
    start = time.perf_counter()
    row = {"stage": stage, **probe(1.0).as_dict(), "probe_s": round(time.perf_counter() - start, 1)}
    logging.info("probe %s", row)
    return row


def _done(out: str) -> dict[str, dict]:
    path = os.path.join(out, "probes.jsonl")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    done = {row["stage"]: row for row in rows}
    if "warm start" in done and not os.path.isfile(os.path.join(out, "warm_start", "config.json")):
        del done["warm start"]
    return done


def _record(out: str, row: dict) -> dict:
    with open(os.path.join(out, "probes.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def warm_start(cfg, model, tokenizer, args) -> list[float]:
    """SFT on toy-world demonstrations rendered through the model's chat template (in place); returns epoch losses."""
    from rsearch_verl.config import SFTConfig
    from rsearch_verl.data.dataset import render_prompt
    from rsearch_verl.data.toy_demos import demonstrations
    from rsearch_verl.data.toy_world import build_toy_world
    from rsearch_verl.rollout.protocols import protocol_for
    from rsearch_verl.sft import train_sft

    proto = protocol_for(cfg)
    world = build_toy_world(cfg.data.toy_world)
    demos = demonstrations(world, cfg.rollout.protocol, args.sft_demos, seed=args.seed, p_no_search=args.p_no_search,
                           variant=cfg.prompt_variant, topk=cfg.retriever.topk, tokenizer=tokenizer)  # fmt: skip
    for demo in demos:
        demo["prompt"] = render_prompt(demo["prompt"], tokenizer, proto.tools, proto.chat_template_kwargs)
    opts = SFTConfig(epochs=args.sft_epochs, lr=args.sft_lr, batch_size=4, warmup_steps=4, seed=args.seed)
    return train_sft(model, tokenizer, demos, opts)


def run_rl(args, sft_dir: str | None) -> list[dict]:
    run_dir = os.path.join(args.out, "rl")
    cmd = [sys.executable, "-m", "rsearch_verl.main", "model=smollm2_135m", f"+recipe={args.recipe}", *RL]
    cmd += sizes(args.recipe)
    cmd += [f"trainer.total_steps={args.rl_steps}", f"data.val_max_samples={args.val_questions}"]
    cmd += [f"trainer.run_dir={run_dir}", "trainer.resume=disable", f"data.toy_world.cache_dir={args.toy_cache}"]
    cmd += [f"model.sft_checkpoint={sft_dir}"] if sft_dir else []
    proc = subprocess.run([*cmd, *args.extra], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"RL main job failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def hop_rewards(run_dir: str, steps: list[int]) -> dict[int, str]:
    """Per step, "1hop a/n  2hop b/m": correct of sampled trajectories by question kind, from the run's rollout
    dumps (a step's reward mostly says which kind its 2 prompts were: 2-hop questions are much harder)."""
    out = {}
    for step in steps:
        path = os.path.join(run_dir, "rollouts", f"step_{step}.jsonl")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        kinds = sorted({r["data_source"] for r in rows})
        out[step] = "  ".join(
            f"{k.rsplit('_', 1)[-1]} {sum(r['reward'] >= 1.0 for r in rows if r['data_source'] == k):.0f}/"
            f"{sum(r['data_source'] == k for r in rows)}"
            for k in kinds
        )
    return out


def report(probes: list[dict], rl: list[dict], args) -> list[str]:
    lines = [f"{'stage':<12}{'search_rate':>12}{'searched_em':>12}{'no_search_em':>13}{'n':>4}{'probe_s':>9}"]
    for p in probes:
        lines.append(f"{p['stage']:<12}{p['search_rate']:>12.3f}{p['searched_em']:>12.3f}{p['no_search_em']:>13.3f}"
                     f"{p['n']:>4}{p['probe_s']:>9.1f}")  # fmt: skip
    vals = [r for r in rl if "val/em" in r]
    steps = [r for r in rl if r["step"] >= 1]
    hops = hop_rewards(os.path.join(args.out, "rl"), [r["step"] for r in steps])
    lines.append(f"RL {args.recipe}, {len(steps)} steps x 8 trajectories (2 prompts x 4), lr from actor.optim.lr")
    for r in steps:
        lines.append(f"  step {r['step']:>2}: reward {r['reward/mean']:.3f}  searches {r['rollout/searches_mean']:.2f}"
                     f"  grad norm {r['actor/grad_norm']:.1e}  logprob gap {r['rollout/logprob_abs_diff_max']:.1e}"
                     f"  {r['timing/step_s']:.0f} s  correct: {hops.get(r['step'], '?')}")  # fmt: skip
    first, last = vals[0], vals[-1]
    em, searches = (first["val/em"], last["val/em"]), (first["val/searches_mean"], last["val/searches_mean"])
    by_hop = "; ".join(f"{k.split('/')[1][10:]} {first[k]:.3f} -> {last[k]:.3f}" for k in sorted(first)
                       if k.startswith("val/toy_world_") and k in last)  # fmt: skip
    lines.append(f"  val (held-out toy world, greedy, {args.val_questions} q): em {em[0]:.3f} -> {em[1]:.3f} "
                 f"({by_hop}), searches {searches[0]:.2f} -> {searches[1]:.2f}")  # fmt: skip
    rates = " -> ".join(f"{p['stage']} {p['search_rate']:.2f}" for p in probes)
    lines.append(f"search rate (probe) {rates}; val searches after RL {last['val/searches_mean']:.2f}, "
                 f"val em {first['val/em']:.3f} -> {last['val/em']:.3f}")  # fmt: skip
    return lines


def measure_stages(cfg, args, probes: dict[str, dict], sft_dir: str | None) -> None:
    """Probes zero-shot and (with `sft_dir`) warm-starts and probes again, recording each stage into `probes`. The
    model lives only in this function, so that it is freed on return, before the RL job runs beside this process."""
    from rsearch_verl.rollout.protocols import protocol_for
    from rsearch_verl.sft import load_policy, save_hf
    from rsearch_verl.warm_start import SkillProbe

    model, tokenizer = load_policy(cfg, seed=args.seed)
    probe = SkillProbe(cfg, model, tokenizer, args.probe_questions, protocol=protocol_for(cfg))
    try:
        if "zero-shot" not in probes:
            probes["zero-shot"] = _record(args.out, probe_row("zero-shot", probe))
        if sft_dir and "warm start" not in probes:
            start = time.perf_counter()
            losses = warm_start(cfg, model, tokenizer, args)
            logging.info("warm start: losses %s in %.0f s", losses, time.perf_counter() - start)
            save_hf(model, tokenizer, sft_dir)
            probes["warm start"] = _record(args.out, probe_row("warm start", probe))
    finally:
        probe.close()


def _malloc_trim() -> None:
    """Hands the memory freed by the SFT back to the OS (glibc keeps freed heap pages otherwise)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rss_gb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 2**20


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="search_r1_grpo", choices=["search_r1_grpo", "search_r1_toolcall_grpo"])
    parser.add_argument("--out", default="outputs/smollm2_learning")
    parser.add_argument("--toy-cache", default="~/.cache/rsearch_verl/toy_world")
    parser.add_argument("--sft-demos", type=int, default=96, help="0: no warm start")
    parser.add_argument("--sft-epochs", type=int, default=1)
    parser.add_argument("--sft-lr", type=float, default=1e-4)
    parser.add_argument("--p-no-search", type=float, default=0.5, help="share of demos answering from memory")
    parser.add_argument("--probe-questions", type=int, default=16)
    parser.add_argument("--val-questions", type=int, default=16)
    parser.add_argument("--rl-steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("extra", nargs="*", help="Hydra overrides for the RL job")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rsearch_verl.config import load_config

    os.makedirs(args.out, exist_ok=True)
    cfg = load_config(["model=smollm2_135m", f"+recipe={args.recipe}", *sizes(args.recipe),
                       f"data.toy_world.cache_dir={args.toy_cache}"])  # fmt: skip
    probes = _done(args.out)  # a rerun with the same --out reuses measured stages and the saved warm start
    sft_dir = os.path.join(args.out, "warm_start") if args.sft_demos > 0 else None
    stages = ["zero-shot"] + (["warm start"] if sft_dir else [])
    if any(stage not in probes for stage in stages):
        measure_stages(cfg, args, probes, sft_dir)
    gc.collect()  # the policy and the probe's engine are gone before the RL job starts beside this process
    _malloc_trim()
    logging.info("benchmark process RSS before RL: %.2f GB", _rss_gb())
    probes = [probes[stage] for stage in stages]
    rl = run_rl(args, sft_dir) if args.rl_steps > 0 else []
    lines = report(probes, rl, args) if rl else [json.dumps(p) for p in probes]
    with open(os.path.join(args.out, "report.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    for line in lines:
        print(line)  # the benchmark's table
    return lines


if __name__ == "__main__":
    main()
