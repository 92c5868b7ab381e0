"""Per-turn prefill tokens of a long trajectory with and without context management (rollout.context).

A scripted policy that always searches (the real HF engine and tiny policy of the deep recipe, its turns forced by
rsearch_verl/testing/scripted_engines.py) runs TURNS turns against a REAL BM25 retrieval server over the deep toy
world's corpus (`python -m retrieval_server build/serve`), once per strategy: `none` without a budget (one growing
sequence: what a turn costs when nothing is managed), `none` at the model's budget (ends at it), drop_observations and
summary at the deep recipe's budget. Each generation's prefill (the context it reads, no prefix cache) is recorded.
Prints a table of prefill tokens at chosen turns, the mean over the last 8 turns, folds and the turn count, then a last
line: none (no budget) / drop_observations mean prefill over the last 8 turns, `N.NNx`.

    .venv/bin/python benchmarks/long_horizon.py [--turns 64]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import tempfile

import numpy as np

from rsearch_verl.config import load_config
from rsearch_verl.config.context import context_budget
from rsearch_verl.models import build_tiny_qwen2
from rsearch_verl.rollout.agent_loop import run_trajectory
from rsearch_verl.rollout.context import NOTE_CLOSE, NOTE_OPEN
from rsearch_verl.rollout.engines import SamplingParams
from rsearch_verl.rollout.protocols import protocol_for
from rsearch_verl.search.client import SearchClient
from rsearch_verl.search.service import free_port, wait_healthy
from rsearch_verl.testing.scripted_engines import ScriptedHFEngine
from rsearch_verl.toy.tokenizer import toy_tokenizer
from rsearch_verl.toy.world import build_toy_world

logger = logging.getLogger("benchmarks.long_horizon")
SHOW = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)


def _serve(corpus: str, root: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    index = os.path.join(root, "index")
    build = [sys.executable, "-m", "retrieval_server", "build", "--corpus", corpus, "--encoder", "bm25"]
    subprocess.run([*build, "--index-type", "flat", "--out", index], check=True, env=env, timeout=600)
    port = free_port()
    serve = [sys.executable, "-m", "retrieval_server", "serve", "--index", index, "--port", str(port)]
    proc = subprocess.Popen([*serve, "--host", "127.0.0.1", "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 120.0, proc)
    return proc, url


def _script(names: list[str]):
    def script(ctx: str) -> str:
        if ctx.endswith(NOTE_OPEN):
            return f" searching the mentors of {names[0]} {NOTE_CLOSE}"
        turn = ctx.count("</search>")
        return f"<search> the mentor of {names[turn % len(names)]} </search>"

    return script


def run(strategy: str, budget: int | None, turns: int, url: str, tok, world) -> dict:
    overrides = ["+recipe=deep_search_grpo", f"rollout.max_turns={turns}", f"retriever.url={url}"]
    overrides += [f"rollout.context.strategy={strategy}"]
    if budget is None:  # one growing sequence, as long as it gets
        overrides += ["model.max_context=1000000", "rollout.max_response_length=200000"]
    cfg = load_config(overrides)
    model = build_tiny_qwen2(cfg.model.tiny, len(tok), seed=0)
    people = [e.name for e in world.entities if e.kind == "person" and e.side == "train"]
    engine = ScriptedHFEngine(model, tok, _script(people))
    protocol = protocol_for(cfg)
    prompt = tok.encode(protocol.build_prompt(world.questions("train")[0]["question"], "base"))
    sampling = SamplingParams(temperature=1.0, max_tokens=cfg.rollout.max_tokens_per_turn, seed=0)
    search = SearchClient(cfg.retriever)
    try:
        traj = asyncio.run(run_trajectory(engine, tok, protocol, search, prompt, cfg, sampling))
    finally:
        engine.close()
    return {"prefill": traj.context_lens, "folds": traj.folds, "turns": traj.n_turns, "end": traj.finish_reason,
            "budget": context_budget(cfg)}  # fmt: skip


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=64)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cfg = load_config(["+recipe=deep_search_grpo"])
    world = build_toy_world(cfg.data.toy_world)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(toy_tokenizer(world, ["search_r1"]))
    with tempfile.TemporaryDirectory() as root:
        proc, url = _serve(world.corpus_path, root)
        try:
            rows = {
                "none (no budget)": run("none", None, args.turns, url, tok, world),
                "none (budget)": run("none", 0, args.turns, url, tok, world),
                "drop_observations": run("drop_observations", 0, args.turns, url, tok, world),
                "summary": run("summary", 0, args.turns, url, tok, world),
            }
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    shown = [t for t in SHOW if t <= args.turns]
    print(f"prefill tokens per generation ({args.turns} turns, always searching; the deep recipe's budget)")
    print(
        f"{'strategy':<20}"
        + "".join(f"{'t' + str(t):>7}" for t in shown)
        + f"{'last8':>8}{'folds':>7}{'turns':>7}  end"
    )
    for name, r in rows.items():
        cells = "".join(f"{r['prefill'][t - 1] if t <= len(r['prefill']) else '-':>7}" for t in shown)
        last8 = float(np.mean(r["prefill"][-8:]))
        print(f"{name:<20}{cells}{last8:>8.0f}{r['folds']:>7}{r['turns']:>7}  {r['end']}")
    ratio = np.mean(rows["none (no budget)"]["prefill"][-8:]) / np.mean(rows["drop_observations"]["prefill"][-8:])
    print(f"none (no budget) / drop_observations, mean prefill over the last 8 turns: {ratio:.2f}x")
    return float(ratio)


if __name__ == "__main__":
    main()
