"""Evaluate a checkpoint with search over one or many QA datasets and print the papers' table.

Each dataset is a parquet file made by `python -m rsearch_verl.data.prepare` (or the toy world's val split). The
checkpoint runs in the recipe's rollout engine (HF on CPU, vLLM on GPU) through the same agent loop and protocol as
training, greedy by default, against the recipe's retriever (`retriever.url`, or a server started for the run).
Per dataset and on average: EM, F1, cover-EM (answer contains a gold), searches per question, and the recipe's
reward (which may call a judge). Every example goes to `<out>/<dataset>.jsonl`; the table to `<out>/results.json`.
With k samples per question (`rollout.val_n=K rollout.val_temperature=T`) it adds Avg@k and Pass@k of EM, F1 and
cover-EM (`--pass-k 1,4`: which k, default K; the unbiased estimator when k < K; eval/sampling.py). `--judge` adds
the `judge` column: the verdict of `reward.judge`'s OpenAI-compatible endpoint, failures counted (eval/judged.py).
Under the table it prints the protocol card (eval/protocol_card.py, also in `<out>/protocol_card.txt`): each paper's
datasets, split sizes, corpus, retriever, top-k and metric, with every setting of this run that differs flagged.

    python -m rsearch_verl.eval --checkpoint outputs/run/checkpoints/step_000020/actor/hf \
        --data data/nq_test.parquet data/hotpotqa_test.parquet --out outputs/eval_run \
        +recipe=search_r1_ppo retriever.url=http://127.0.0.1:8000
    python -m rsearch_verl.eval --checkpoint tiny --toy-world --out outputs/eval_toy +recipe=search_r1_ppo

Any further arguments are Hydra overrides of the recipe (`rollout.engine=vllm`, `rollout.val_temperature=0.7`, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os

import numpy as np

from rsearch_verl.config import RSearchConfig, load_config
from rsearch_verl.data.dataset import PromptDataset
from rsearch_verl.eval.judged import judge_rows
from rsearch_verl.eval.protocol_card import format_card, run_settings
from rsearch_verl.eval.sampling import sample_metrics, samples_per_question
from rsearch_verl.rewards.judge import require_judge_url
from rsearch_verl.rewards.qa import cover_exact_match, exact_match, f1_score
from rsearch_verl.rollout.protocols import SearchProtocol, protocol_for
from rsearch_verl.toy.world_data import toy_world_data

logger = logging.getLogger(__name__)

COLUMNS = ("em", "f1", "cover_em", "searches", "reward")
SAMPLED = ("em", "f1", "cover_em", "judge")  # the columns that get Avg@k / Pass@k (judge only when judged)


def example_rows(batch) -> list[dict]:
    """One JSON-able record per evaluated trajectory, with its metrics."""
    nt = batch.non_tensor_batch
    rows = []
    for i in range(len(batch)):
        golds = [str(g) for g in nt["ground_truth"][i]]
        answer = nt["answer"][i] or ""
        rows.append(
            {
                "id": str(nt["index"][i]),
                "data_source": str(nt["data_source"][i]),
                "question": str(nt["question"][i]),
                "golden_answers": golds,
                "answer": answer,
                "response": str(nt["response_text"][i]),
                "em": exact_match(answer, golds),
                "f1": f1_score(answer, golds),
                "cover_em": cover_exact_match(answer, golds),
                "searches": int(nt["n_searches"][i]),
                "reward": float(nt["reward"][i]),
                "finish_reason": str(nt["finish_reason"][i]),
            }
        )
    return rows


def evaluate_dataset(
    engine, tokenizer, dataset: PromptDataset, cfg: RSearchConfig, protocol: SearchProtocol
) -> list[dict]:
    """Run every prompt of `dataset` through the agent loop and score it with the recipe's reward."""
    # heavy: the rollout / reward stack (pandas and more) loads only when a dataset is evaluated
    from rsearch_verl.rollout.agent_loop import generate_batch
    from rsearch_verl.trainer.phases import reward_phase

    limit = len(dataset) if cfg.data.val_max_samples < 0 else min(len(dataset), cfg.data.val_max_samples)
    rows: list[dict] = []
    for start in range(0, limit, cfg.data.val_batch_size):
        idx = list(range(start, min(limit, start + cfg.data.val_batch_size)))
        prompts = dataset.to_batch(idx, uids=[f"eval-{i}" for i in idx])
        prompts.meta_info.update(validate=True, seed=cfg.seed)
        batch = generate_batch(engine, tokenizer, prompts, cfg, protocol=protocol)
        batch, _ = reward_phase(batch, cfg, protocol)
        rows.extend(example_rows(batch))
    return rows


def summarise(per_dataset: dict[str, list[dict]], ks: tuple[int, ...] = ()) -> dict[str, dict[str, float]]:
    """Mean of each column per dataset, plus the unweighted average over datasets (as the papers report). `n` counts
    trajectories; with several samples per question, Avg@k / Pass@k (for each k in `ks`, default all samples) too,
    and judged rows add `judge` and `judge_errors`."""
    table = {}
    for name, rows in per_dataset.items():
        judged = bool(rows) and "judge" in rows[0]
        columns = COLUMNS + ("judge",) if judged else COLUMNS
        table[name] = {"n": len(rows), **{c: float(np.mean([r[c] for r in rows])) if rows else 0.0 for c in columns}}
        n = samples_per_question(rows)
        if n > 1:
            metrics = [m for m in SAMPLED if m in columns]
            table[name].update(sample_metrics(rows, metrics, ks or (n,)))
        if judged:
            table[name]["judge_errors"] = sum(int(r["judge_error"]) for r in rows)
    if table:
        shared = [c for c in next(iter(table.values())) if c != "n" and all(c in t for t in table.values())]
        table["average"] = {"n": sum(t["n"] for t in table.values())}
        table["average"].update({c: float(np.mean([table[n][c] for n in per_dataset])) for c in shared})
        if "judge_errors" in shared:
            table["average"]["judge_errors"] = sum(table[n]["judge_errors"] for n in per_dataset)
    return table


def format_table(table: dict[str, dict[str, float]]) -> str:
    """The table as text: one line per dataset, a column per metric (`n` and `judge_errors` as integers)."""
    columns = [c for c in next(iter(table.values()), {}) if c != "n"]
    widths = [max(10, len(c) + 2) for c in columns]
    head = f"{'dataset':<24}{'n':>6}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True))
    lines = [head, "-" * len(head)]
    for name, row in table.items():
        cells = [
            f"{row.get(c, float('nan')):>{w}{'.0f' if c == 'judge_errors' else '.3f'}}"
            for c, w in zip(columns, widths, strict=True)
        ]
        lines.append(f"{name:<24}{int(row['n']):>6}" + "".join(cells))
    return "\n".join(lines)


def _datasets(
    args, cfg: RSearchConfig, tokenizer, proto: SearchProtocol
) -> tuple[dict[str, PromptDataset], str | None, str | None]:
    """The datasets to evaluate, and the corpus / index the recipe's own retriever would serve."""
    limit = cfg.data.max_prompt_length
    if args.toy_world:
        data = toy_world_data(cfg, proto)
        toy = PromptDataset(data.val_rows, tokenizer, limit, name="toy_world", protocol=proto)
        return {"toy_world": toy}, data.corpus, data.index_dir
    out = {}
    for path in args.data:
        name = os.path.splitext(os.path.basename(path))[0]
        out[name] = PromptDataset.from_parquet([path], tokenizer, limit, protocol=proto)
    return out, cfg.retriever.corpus, cfg.retriever.index_dir


def run_eval(args, overrides: list[str]) -> tuple[dict[str, dict[str, float]], str]:
    """Evaluate every dataset; return the scores table and the protocol card of this run's settings."""
    # heavy: models, engines and the retriever service load only when an evaluation runs
    from rsearch_verl.models import load_model, policy_tokenizer
    from rsearch_verl.rollout.engines import make_engine
    from rsearch_verl.run_context import RunContext
    from rsearch_verl.search.service import RetrieverService

    recipe_cfg = load_config(overrides)
    check_eval_options(args, recipe_cfg)  # before any model loads
    protocol = protocol_for(recipe_cfg)  # this process's one instance: prompts, rollouts and rewards
    # the checkpoint under evaluation is the model (not the recipe's warm start); on the toy world it brings its
    # tokenizer, or, for a random tiny policy, the toy world's own is trained (unless the recipe names one)
    ctx = RunContext(model_path=args.checkpoint)
    if args.toy_world and args.checkpoint != "tiny":
        ctx = RunContext(model_path=args.checkpoint, tokenizer_path=args.checkpoint)
    elif args.toy_world:
        toy_tokenizer = toy_world_data(ctx.apply(recipe_cfg), protocol).tokenizer_path
        ctx = RunContext(model_path="tiny", tokenizer_path=toy_tokenizer)
    cfg = ctx.apply(recipe_cfg)
    tokenizer = policy_tokenizer(cfg)
    datasets, corpus, index_dir = _datasets(args, cfg, tokenizer, protocol)
    os.makedirs(args.out, exist_ok=True)
    with contextlib.ExitStack() as stack:
        service = RetrieverService(cfg.retriever, corpus, index_dir, log_path=os.path.join(args.out, "retriever.log"))
        cfg = dataclasses.replace(ctx, retriever_url=stack.enter_context(service)).apply(recipe_cfg)
        engine = make_engine(cfg.rollout, load_model(cfg.model, tokenizer, seed=cfg.seed), tokenizer)
        stack.callback(engine.close)
        per_dataset = {}
        for name, dataset in datasets.items():
            per_dataset[name] = evaluate_dataset(engine, tokenizer, dataset, cfg, protocol)
            if args.judge:
                judge_rows(per_dataset[name], cfg.reward.judge)
            with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
                for row in per_dataset[name]:
                    f.write(json.dumps(row) + "\n")
    table = summarise(per_dataset, tuple(args.pass_k))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(table, f, indent=2)
    settings = run_settings(cfg, _sizes_by_source(per_dataset))
    if args.judge:  # the card then no longer flags the papers' judge metric as missing
        settings["metrics"] = (*settings["metrics"], "judge")
    card = format_card(settings)
    with open(os.path.join(args.out, "protocol_card.txt"), "w") as f:
        f.write(card + "\n")
    return table, card


def check_eval_options(args, cfg: RSearchConfig) -> None:
    """Refuse, before the work, what would fail after it: --judge without an endpoint, a Pass@k beyond val_n."""
    if args.judge:
        require_judge_url(cfg.reward.judge, "python -m rsearch_verl.eval --judge")
    too_big = [k for k in args.pass_k if not 1 <= k <= cfg.rollout.val_n]
    if too_big:
        raise ValueError(f"--pass-k {too_big}: each k must be in 1..rollout.val_n={cfg.rollout.val_n}")


def _sizes_by_source(per_dataset: dict[str, list[dict]]) -> dict[str, int]:
    """Questions per dataset (not samples), named by the rows' data_source (whatever the file is called)."""
    ids: dict[str, set[str]] = {}
    for rows in per_dataset.values():
        for row in rows:
            ids.setdefault(row["data_source"], set()).add(row["id"])
    return {source: len(found) for source, found in ids.items()}


EXAMPLES = """examples:
  # the toy world's held-out split, a random tiny policy (a smoke test: EM ~0), or a run's checkpoint
  .venv/bin/python -m rsearch_verl.eval --checkpoint tiny --toy-world --max-samples 8 --out outputs/eval_toy
  .venv/bin/python -m rsearch_verl.eval --checkpoint RUN_DIR/checkpoints/step_000020/actor/hf --toy-world \\
      --out outputs/eval_run +recipe=search_r1_ppo
  # benchmark parquet files (python -m rsearch_verl.data.prepare) against a running retrieval server
  .venv/bin/python -m rsearch_verl.eval --checkpoint CKPT --data data/nq/test.parquet --out outputs/eval_nq \\
      +recipe=search_r1_ppo retriever.url=http://127.0.0.1:8000
  # 4 samples per question (Avg@4, Pass@1, Pass@4) and a judge's verdict beside EM / F1
  .venv/bin/python -m rsearch_verl.eval --checkpoint CKPT --data data/bcp/test.parquet --out outputs/eval_bcp \\
      --pass-k 1,4 --judge rollout.val_n=4 rollout.val_temperature=0.7 reward.judge.url=http://127.0.0.1:8001"""


def checkpoint_arg(value: str) -> str:
    """--checkpoint: 'tiny', `package:NAME`, a hub name (`org/name`, GPU clusters) or an existing local directory;
    a local-looking path that does not exist fails here, naming it (it used to reach the hub client, whose error
    was about repo id characters)."""
    local = value.startswith(("/", ".", "~")) or value.count("/") >= 2
    if local and not os.path.isdir(os.path.expanduser(value)):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a directory: give a run's HF export (RUN_DIR/checkpoints/step_N/actor/hf), a model "
            "directory, or 'tiny'"
        )
    return os.path.expanduser(value) if local else value


def _ks(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(k) for k in value.split(",") if k.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{value!r}: give comma-separated integers, e.g. 1,4") from e


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rsearch_verl.eval",
        description="Evaluate a checkpoint with search; extra arguments are Hydra overrides of the recipe "
        "(default +recipe=search_r1_ppo).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--checkpoint", required=True, type=checkpoint_arg, help="HF model directory (e.g. <ckpt>/actor/hf) or 'tiny'"
    )
    parser.add_argument("--data", nargs="*", default=[], help="parquet files from rsearch_verl.data.prepare")
    parser.add_argument("--toy-world", action="store_true", help="evaluate on the toy world's held-out split")
    parser.add_argument("--out", required=True, help="output directory (per-example JSONL and results.json)")
    parser.add_argument("--max-samples", type=int, default=-1, help="per dataset; -1: all")
    parser.add_argument(
        "--pass-k", type=_ks, default=(), help="Pass@k for these k (comma-separated, each <= rollout.val_n; "
        "default: rollout.val_n) when rollout.val_n > 1",
    )  # fmt: skip
    parser.add_argument("--judge", action="store_true", help="add the judge column (reward.judge.url / model)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    if not args.data and not args.toy_world:
        parser.error("give --data FILE ... or --toy-world")
    if not any(o.startswith("+recipe=") for o in overrides):
        overrides = ["+recipe=search_r1_ppo", *overrides]
    greedy = ["rollout.val_temperature=0.0", "rollout.val_n=1", f"data.val_max_samples={args.max_samples}"]
    table, card = run_eval(args, [*greedy, *overrides])
    print(format_table(table) + "\n\n" + card)  # noqa: T201 - the CLI's output
    return table
