"""Supervised fine-tuning on search demonstrations: the cold start before RL (R1-Searcher++-style) and the toy world's
warm start.

A demonstration is `{"prompt": str, "segments": [[role, text], ...]}` with role "policy" (trained) or "observation"
(context only, label masked exactly as in RL, so SFT never teaches the model to write retrieved text). Each segment
is tokenised on its own, as the agent loop does, and an EOS ends the last policy segment.

    python -m rsearch_verl.sft --demos demos.jsonl --out outputs/sft model.path=tiny model.tokenizer_path=TOK
    python -m rsearch_verl.sft --toy-world --out outputs/sft +recipe=search_r1_ppo      # the toy world's demos

`warm_start(cfg)` is what the trainer calls when `model.sft_checkpoint=auto`: build (or reuse, cached by a hash of
the model, protocol and world settings) a warm start for the toy world and return its HF directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile

import torch

from rsearch_verl.config import RSearchConfig, load_config

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SFTOptions:
    epochs: int = 2
    lr: float = 3e-4  # peak; linear warmup over `warmup_steps`, then linear decay to 10 %
    batch_size: int = 8
    max_length: int = 640  # a 2-hop Search-R1 toy demonstration (top-1 passages) is ~250-300 tokens
    seed: int = 0
    warmup_steps: int = 20
    # toy world demos: the share that answers from "memory" without searching (> 0.5: the warm start's greedy choice
    # is not to search, and RL has to discover that searching pays)
    p_no_search: float = 0.6
    n_demos: int = 2048  # toy world demos (rsearch_verl/data/toy_demos.py, practice facts: nothing to memorise)
    # Toy world curriculum (`train_toy`): first up to `copy_epochs` on demos of which only `copy_p_no_search` answer
    # without searching, at `copy_lr`, until an epoch's mean loss is below `copy_until`; then `epochs` on the
    # imperfect mix at `lr`. Copying names and answers appears suddenly, after 3 to 7 search-only epochs depending on
    # the seed (from scratch on the mix, 60 % of which carries no copying, it took 8 to > 14 epochs). The mix epochs
    # only shift the search / no-search prior: every text in them was already learnt.
    copy_epochs: int = 8
    copy_lr: float = 3e-3
    copy_until: float = 0.045  # the floor is ~0.035 (the 15 % guesses); copying is in place by ~0.045
    copy_p_no_search: float = 0.15


def tokenize_demo(tokenizer, prompt: str, segments: list, max_length: int) -> tuple[list[int], list[int]]:
    """Token ids of prompt + segments and the loss mask (1 on policy tokens and the final EOS)."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    for role, text in segments:
        seg = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += seg
        mask += [1 if role == "policy" else 0] * len(seg)
    ids.append(tokenizer.eos_token_id)
    mask.append(1)
    return ids[:max_length], mask[:max_length]


def _collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.float32)
    for row, (ids, mask) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        loss_mask[row, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}


def sft_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean cross-entropy of next-token prediction over positions whose target has loss mask 1."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets, weights = batch["input_ids"][:, 1:], batch["loss_mask"][:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
    return (nll * weights).sum() / weights.sum().clamp(min=1.0)


def length_batches(examples: list, batch_size: int) -> list[list]:
    """Batches of similar length (sorted, then chunked): padding, most of the cost on CPU, nearly vanishes."""
    ordered = sorted(examples, key=lambda e: len(e[0]))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def train_sft(model, tokenizer, demos: list[dict], opts: SFTOptions, stop_below: float = 0.0) -> list[float]:
    """Train `model` in place on `demos`; returns the mean loss of each epoch (stops early after an epoch whose
    mean loss is below `stop_below`)."""
    examples = [tokenize_demo(tokenizer, d["prompt"], d["segments"], opts.max_length) for d in demos]
    batches = length_batches(examples, opts.batch_size)
    optim = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.0)
    total = max(1, opts.epochs * len(batches))
    warmup = max(1, opts.warmup_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / total))
    rng = random.Random(opts.seed)
    model.train()
    history = []
    for epoch in range(opts.epochs):
        rng.shuffle(batches)  # batch order is random; batch contents stay length-sorted
        losses = []
        for batch in batches:
            loss = sft_loss(model, _collate(batch, tokenizer.pad_token_id))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            losses.append(loss.item())
        history.append(sum(losses) / max(1, len(losses)))
        logger.info("sft epoch %d/%d: loss %.4f", epoch + 1, opts.epochs, history[-1])
        if history[-1] < stop_below:
            break
    model.eval()
    return history


def save_hf(model, tokenizer, out_dir: str) -> str:
    """Write model + tokenizer as a HF directory atomically (temp dir, then rename)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-sft-", dir=parent)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def _load(cfg: RSearchConfig):
    from rsearch_verl.models import load_model, load_tokenizer
    from rsearch_verl.rollout.protocols import get_protocol

    proto = get_protocol(cfg.rollout.protocol, **cfg.rollout.protocol_kwargs)
    tokenizer = load_tokenizer(cfg.model, extra_special=proto.special_tokens)
    return load_model(cfg.model, tokenizer, seed=cfg.seed), tokenizer


def train_toy(model, tokenizer, cfg: RSearchConfig, opts: SFTOptions) -> list[float]:
    """The toy world's warm start (see SFTOptions): demos that mostly search (other facts than the mix's) until the
    policy copies, then the imperfect mix (`opts.p_no_search` answer without searching); returns the epoch losses."""
    history = []
    if opts.copy_epochs > 0:
        demos = toy_demos(cfg, opts.n_demos, p_no_search=opts.copy_p_no_search, seed=cfg.seed + 1)
        copy = dataclasses.replace(opts, epochs=opts.copy_epochs, lr=opts.copy_lr)
        history += train_sft(model, tokenizer, demos, copy, stop_below=opts.copy_until)
    demos = toy_demos(cfg, opts.n_demos, p_no_search=opts.p_no_search, seed=cfg.seed)
    return history + train_sft(model, tokenizer, demos, opts)


def toy_demos(cfg: RSearchConfig, n: int, p_no_search: float = 0.5, seed: int | None = None) -> list[dict]:
    from rsearch_verl.data.toy_demos import demonstrations
    from rsearch_verl.data.toy_world import build_toy_world

    world = build_toy_world(cfg.data.toy_world)
    topk = cfg.retriever.topk  # the demos' observations look exactly like the RL rollouts' ones
    seed = cfg.seed if seed is None else seed
    return demonstrations(world, cfg.rollout.protocol, n, seed=seed, p_no_search=p_no_search, topk=topk)


def warm_start(cfg: RSearchConfig, opts: SFTOptions | None = None) -> str:
    """The toy world's warm start for `cfg` (built once, then reused from the cache); returns its HF directory."""
    opts = opts or SFTOptions(seed=cfg.seed)
    key = json.dumps(
        [dataclasses.asdict(cfg.model), cfg.rollout.protocol, dataclasses.asdict(cfg.data.toy_world), vars(opts)],
        sort_keys=True,
        default=str,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    out = os.path.join(os.path.expanduser(cfg.data.toy_world.cache_dir), "warm_start", digest)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    model_cfg = dataclasses.replace(cfg.model, sft_checkpoint=None)
    model, tokenizer = _load(dataclasses.replace(cfg, model=model_cfg))
    history = train_toy(model, tokenizer, cfg, opts)
    logger.info("warm start trained (loss %s) -> %s", [round(x, 3) for x in history], out)
    return save_hf(model, tokenizer, out)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m rsearch_verl.sft", description=__doc__.split("\n\n")[0])
    parser.add_argument("--demos", help="JSONL demonstrations ({prompt, segments})")
    parser.add_argument("--toy-world", action="store_true", help="use the toy world's synthetic demonstrations")
    parser.add_argument("--out", required=True)
    for field in dataclasses.fields(SFTOptions):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    args, overrides = parser.parse_known_args(argv)
    if not args.demos and not args.toy_world:
        parser.error("give --demos FILE or --toy-world")
    cfg = load_config(overrides)
    opts = SFTOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SFTOptions)})
    if args.toy_world and cfg.model.path == "tiny" and cfg.model.tokenizer_path is None:
        from rsearch_verl.trainer.session import toy_world_data

        cfg.model.tokenizer_path = toy_world_data(cfg).tokenizer_path
    if args.demos:
        with open(args.demos) as f:
            demos = [json.loads(line) for line in f if line.strip()]
    model, tokenizer = _load(cfg)
    if args.demos:
        train_sft(model, tokenizer, demos, opts)
    else:
        train_toy(model, tokenizer, cfg, opts)
    return save_hf(model, tokenizer, args.out)


if __name__ == "__main__":
    from rsearch_verl.main import setup_logging

    setup_logging()
    main()
