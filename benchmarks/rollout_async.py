"""Async per-trajectory agent loop versus a turn-synchronous loop (Search-R1 style), in the same run.

Same HF engine (tiny random Qwen2 on CPU), same prompts, same retriever: a local uvicorn app speaking the
Search-R1 wire format that sleeps `--latency-ms` per request (requests overlap, as a real server's would).
Trajectories have mixed turn counts: prompt i asks for i % 4 searches (0..3) before answering. A tiny random model
never writes tags by itself, so the turn text is SCRIPTED: `ScriptedHFEngine` forces each turn's first tokens
(`<think> … </think><search> q </search>` or `<answer> … </answer>`) through the real decode loop; after the
script the model samples freely (that is what a loop without stop strings keeps generating and then throws away).

Rows:
  async (ours)        generate_batch_async: every trajectory on its own, stop strings in the engine, token-in/out
  turn-sync + stop    all active trajectories generate turn t together, then one batched search, then turn t+1
  turn-sync (S-R1)    as above but, like Search-R1, no stop strings: each turn generates up to max_tokens_per_turn,
                      the text is decoded, cut at the first stop tag and RE-TOKENISED (tokens after it discarded;
                      "retok!=" counts turns whose re-tokenised ids differ from the sampled ones)

    .venv/bin/python benchmarks/rollout_async.py                     # 32 trajectories, 50 ms, 128 tokens/turn
    .venv/bin/python benchmarks/rollout_async.py --n 64 --latency-ms 100 --max-tokens-per-turn 256

Prints a table and, last, the speed-up of ours over the Search-R1-style turn-synchronous loop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import socket
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402

from rsearch_verl.config import RSearchConfig, TinyModelConfig  # noqa: E402
from rsearch_verl.data.dataset import PromptDataset  # noqa: E402
from rsearch_verl.models import DEFAULT_TOKENIZER_TEXTS, build_tiny_qwen2, train_bpe_tokenizer  # noqa: E402
from rsearch_verl.rollout.agent_loop import generate_batch_async, observation_ids  # noqa: E402
from rsearch_verl.rollout.engines import SamplingParams  # noqa: E402
from rsearch_verl.rollout.engines.hf import ScriptedHFEngine  # noqa: E402
from rsearch_verl.rollout.protocols import Action, get_protocol  # noqa: E402
from rsearch_verl.search.client import SearchClient  # noqa: E402

logger = logging.getLogger("rollout_async")


def slow_retriever(latency_s: float) -> FastAPI:
    """Search-R1 wire format (`POST /retrieve`), fixed latency per request, canned passages."""
    app = FastAPI()

    @app.post("/retrieve")
    async def retrieve(request: Request):
        body = await request.json()
        await asyncio.sleep(latency_s)
        k = body.get("topk") or 3
        docs = [{"id": str(j), "contents": f'"Doc {j}"\nPassage {j} about the question.'} for j in range(k)]
        return {"result": [[{"document": d, "score": 1.0} for d in docs] for _ in body["queries"]]}

    return app


def serve(app: FastAPI) -> tuple[uvicorn.Server, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    return srv, f"http://127.0.0.1:{port}"


def script(ctx: str) -> str:
    """The scripted policy: `searches=K` in the prompt -> K search turns, then an answer."""
    want = int(re.search(r"searches=(\d+)", ctx).group(1))
    done = ctx.count("</search>")
    if done < want:
        return f"<think> I need fact {done} </think><search> fact {done} of the question </search>"
    return "<think> enough </think><answer> forty two </answer>"


async def turn_sync(engine, tok, proto, client, prompts: list[list[int]], cfg: RSearchConfig, use_stop: bool):
    """All active trajectories generate turn t together, then one batched search, then turn t+1."""
    rc = cfg.rollout
    resp: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    stats = {"generated": 0, "discarded": 0, "retok_mismatch": 0, "searches": 0}
    for turn in range(rc.max_turns):
        if not active:
            break
        calls = []
        for i in active:
            budget = min(rc.max_tokens_per_turn, rc.max_response_length - len(resp[i]))
            params = SamplingParams(rc.temperature, max_tokens=max(1, budget), seed=1000 * i + turn)
            calls.append(engine.generate(prompts[i] + resp[i], params, proto.stop_strings if use_stop else []))
        outs = await asyncio.gather(*calls)
        queries: dict[int, str] = {}
        for i, out in zip(active, outs, strict=True):
            stats["generated"] += len(out.token_ids)
            kept = list(out.token_ids)
            if not use_stop:  # Search-R1: decode, cut at the first stop tag, re-tokenise
                text = tok.decode(out.token_ids, skip_special_tokens=True)
                ends = [text.find(s) + len(s) for s in proto.stop_strings if s in text]
                text = text[: min(ends)] if ends else text
                kept = tok.encode(text, add_special_tokens=False)
                stats["retok_mismatch"] += int(kept != list(out.token_ids[: len(kept)]))
            stats["discarded"] += len(out.token_ids) - len(kept)
            resp[i] += kept
            action = proto.parse_turn(tok.decode(kept))
            if action.kind == "search" and turn < rc.max_turns - 1:
                queries[i] = action.queries[0]
        if queries:  # one batched request for the whole turn, as Search-R1's batch_search
            order = list(queries)
            results = await client([queries[i] for i in order], cfg.retriever.topk)
            for i, docs in zip(order, results, strict=True):

                async def canned(_q, _k, _s="local", docs=docs):
                    return [docs]

                obs = await proto.observe(Action(kind="search", queries=[queries[i]]), canned, cfg.retriever.topk)
                room = rc.max_response_length - len(resp[i])
                resp[i] += observation_ids(tok, obs, min(rc.max_obs_length, room), proto.observation_close)[0]
                stats["searches"] += 1
        active = [i for i in queries if len(resp[i]) < rc.max_response_length]
    return stats


async def run_all(args) -> list[tuple[str, float, dict]]:
    tok = train_bpe_tokenizer(DEFAULT_TOKENIZER_TEXTS, vocab_size=512)
    tiny = TinyModelConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers)
    engine = ScriptedHFEngine(
        build_tiny_qwen2(tiny, len(tok)), tok, script, max_batch=max(64, args.n), continuous=args.continuous
    )
    srv, url = serve(slow_retriever(args.latency_ms / 1000.0))
    cfg = RSearchConfig()
    cfg.retriever.url, cfg.retriever.cache, cfg.retriever.topk = url, False, 3
    cfg.rollout.max_turns, cfg.rollout.max_tokens_per_turn = 4, args.max_tokens_per_turn
    cfg.rollout.max_response_length, cfg.rollout.max_concurrent_trajectories = 4 * args.max_tokens_per_turn, args.n
    rows = [{"prompt": f"Q{i}: searches={i % 4}\n", "golden_answers": ["42"], "data_source": "bench"} for i in
            range(args.n)]  # fmt: skip
    dataset = PromptDataset(rows, tok, max_prompt_length=64)
    proto = get_protocol("search_r1")
    results = []
    try:
        await engine.generate(dataset.rows[0].prompt_ids, SamplingParams(max_tokens=8), [])  # warm-up
        for _ in range(args.repeats):
            client = SearchClient(cfg.retriever)
            prompts = dataset.to_batch(list(range(args.n)), uids=[f"u{i}" for i in range(args.n)])
            start = time.perf_counter()
            batch = await generate_batch_async(engine, tok, prompts, cfg, search=client, protocol=proto)
            wall = time.perf_counter() - start
            gen = int(batch.batch["response_mask"].sum())
            stats = {"generated": gen, "discarded": 0, "retok_mismatch": 0,
                     "searches": int(sum(batch.non_tensor_batch["n_searches"]))}  # fmt: skip
            results.append(("async (ours)", wall, stats))
            for name, use_stop in (("turn-sync + stop", True), ("turn-sync (S-R1)", False)):
                start = time.perf_counter()
                stats = await turn_sync(engine, tok, proto, client, [r.prompt_ids for r in dataset.rows], cfg, use_stop)
                results.append((name, time.perf_counter() - start, stats))
            await client.aclose()
    finally:
        engine.close()
        srv.should_exit = True
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=32, help="trajectories (prompt i does i %% 4 searches)")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="retriever latency per request")
    parser.add_argument("--max-tokens-per-turn", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--continuous", action="store_true", help="HF engine joins requests mid-decode")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    results = asyncio.run(run_all(args))
    walls: dict[str, list[float]] = {}
    print(f"{args.n} trajectories (0-3 searches each, scripted turn text), "  # noqa: T201
          f"retriever {args.latency_ms:.0f} ms/request, "
          f"max_tokens_per_turn={args.max_tokens_per_turn}, "
          f"tiny Qwen2 h={args.hidden} L={args.layers} on CPU")  # fmt: skip
    head = f"{'loop':<20}{'wall s':>9}{'traj/s':>9}{'searches':>10}{'generated':>11}{'discarded':>11}{'retok!=':>9}"
    print(head)  # noqa: T201
    print("-" * len(head))  # noqa: T201
    for name, wall, s in results:
        walls.setdefault(name, []).append(wall)
        print(f"{name:<20}{wall:>9.2f}{args.n / wall:>9.1f}{s['searches']:>10}{s['generated']:>11}"  # noqa: T201
              f"{s['discarded']:>11}{s['retok_mismatch']:>9}")  # fmt: skip
    mean = {k: sum(v) / len(v) for k, v in walls.items()}
    print(f"speed-up vs turn-sync+stop: {mean['turn-sync + stop'] / mean['async (ours)']:.2f}x")  # noqa: T201
    print(
        f"speed-up async vs turn-synchronous (Search-R1 style): "  # noqa: T201
        f"{mean['turn-sync (S-R1)'] / mean['async (ours)']:.2f}x"
    )


if __name__ == "__main__":
    main()
