"""Supervised fine-tuning on search demonstrations: the cold start before RL (R1-Searcher++-style) and the toy world's
warm start.

A demonstration is `{"prompt": str, "segments": [[role, text], ...]}` with role "policy" (trained) or any other role:
context only, label masked -- "observation" exactly as in RL, so SFT never teaches the model to write retrieved text,
or "guess" (the toy demos' from-memory answer values, shown but not taught); "answer" segments (the toy demos'
searched answer values) are targets like "policy" text. Each segment
is tokenised on its own, as the agent loop does, and an EOS ends the last policy segment.

    python -m rsearch_verl.sft --demos demos.jsonl --out outputs/sft model.path=tiny model.tokenizer_path=TOK

The toy world's warm start (what `model.sft_checkpoint=auto` resolves to) is a curriculum on top of `train_sft`:
rsearch_verl/toy/warm_start.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable

import torch

from rsearch_verl.config import RSearchConfig, SFTConfig, load_config, validate_sft
from rsearch_verl.models import load_model, policy_tokenizer

logger = logging.getLogger(__name__)
PROGRESS_EVERY_S = 30.0  # a log line at least this often while an epoch runs


def tokenize_demo(tokenizer, prompt: str, segments: list, max_length: int) -> tuple[list[int], list[float]]:
    """Token ids of prompt + segments and the loss weights: 1 on "policy" and "answer" tokens and the final EOS, 0 on
    any other role (observations, guesses) and the prompt."""
    weights = {"policy": 1.0, "answer": 1.0}
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    mask = [0.0] * len(ids)
    for role, text in segments:
        seg = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += seg
        mask += [weights.get(role, 0.0)] * len(seg)
    ids.append(tokenizer.eos_token_id)
    mask.append(1.0)
    return ids[:max_length], mask[:max_length]


def demo_example(tokenizer, demo: dict, max_length: int) -> tuple[list[int], list[float]]:
    """(ids, weights) of a demonstration: given as token ids and weights (a row of a folded demonstration,
    rsearch_verl/toy/fold_demos.py) or tokenised from its prompt and segments (`tokenize_demo`)."""
    if "ids" in demo:
        return list(demo["ids"])[:max_length], list(demo["weights"])[:max_length]
    return tokenize_demo(tokenizer, demo["prompt"], demo["segments"], max_length)


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


def sft_loss(
    model, batch: dict[str, torch.Tensor], denominator: float | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Weighted cross-entropy of next-token prediction: the sum over target positions (loss mask > 0) divided by
    `denominator`, by default the batch's own total weight (its token mean). `dtype`: the compute dtype; a lower one
    than the model's float32 masters runs the forward under autocast (the loss itself in float32)."""
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets, weights = batch["input_ids"][:, 1:], batch["loss_mask"][:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
    total = (nll * weights).sum()
    return total / (weights.sum().clamp(min=1.0) if denominator is None else denominator)


def length_batches(examples: list, batch_size: int) -> list[list]:
    """Batches of similar length (sorted, then chunked): padding, most of the cost on CPU, nearly vanishes."""
    ordered = sorted(examples, key=lambda e: len(e[0]))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


@dataclasses.dataclass
class EpochCheckpoint:
    """Where `train_sft` keeps its state after every epoch (model, optimizer, schedule, torch RNG, losses and the
    caller's `save_extra()`; the batch order is replayed from the seed), written atomically, so that a stopped run
    resumes at its next epoch as if it had never stopped (an hour-long warm start spans sessions). `load_extra` gets
    the caller's part back."""

    path: str
    save_extra: Callable[[], dict] = dict
    load_extra: Callable[[dict], None] = lambda extra: None

    def load(self) -> dict | None:
        return torch.load(self.path, weights_only=False) if os.path.isfile(self.path) else None

    def save(self, state: dict) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = f"{self.path}.tmp"
        torch.save({**state, "extra": self.save_extra()}, tmp)
        os.replace(tmp, self.path)


def train_sft(
    model,
    tokenizer,
    demos: list[dict],
    opts: SFTConfig,
    until=None,
    dtype: torch.dtype = torch.float32,
    checkpoint: EpochCheckpoint | None = None,
) -> list[float]:
    """Train `model` in place on `demos`; returns the mean loss of each epoch. `until(epoch, loss) -> bool`, called
    after each epoch with the model in eval mode, stops the training early when it returns True. `dtype`: the compute
    dtype (`model.dtype`; the parameters stay float32 masters). `checkpoint`: saved after every epoch and resumed
    from when it exists (a finished training returns at once)."""
    examples = [demo_example(tokenizer, d, opts.max_length) for d in demos]
    batches = length_batches(examples, opts.batch_size)
    # Every target token weighs the same in every batch: batches are length-sorted, so a per-batch token mean would
    # weigh a token of a short demonstration (answered at once) several times more than one of a long one (searched).
    denominator = max(1.0, sum(sum(w[1:]) for _, w in examples) / len(batches))
    optim, sched = _optimizer(model, opts, total_steps=max(1, opts.epochs * len(batches)))
    rng = random.Random(opts.seed)
    history, start = [], 0
    saved = checkpoint.load() if checkpoint is not None else None
    if saved is not None:
        history, start = _resume(saved, model, optim, sched, checkpoint, rng, batches)
        if saved["done"]:
            model.eval()
            return history
    model.train()
    said = time.monotonic()
    for epoch in range(start, opts.epochs):
        rng.shuffle(batches)  # batch order is random; batch contents stay length-sorted
        losses = []
        for i, batch in enumerate(batches):
            if time.monotonic() - said >= PROGRESS_EVERY_S:  # an epoch can take minutes on CPU: say it is running
                said = time.monotonic()
                logger.info("sft epoch %d/%d: batch %d/%d", epoch + 1, opts.epochs, i, len(batches))
            loss = sft_loss(model, _collate(batch, tokenizer.pad_token_id), denominator, dtype)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            losses.append(loss.item())
        history.append(sum(losses) / max(1, len(losses)))
        logger.info("sft epoch %d/%d: loss %.4f", epoch + 1, opts.epochs, history[-1])
        model.eval()
        done = until is not None and until(epoch + 1, history[-1])
        if checkpoint is not None:
            checkpoint.save({"epoch": epoch + 1, "history": history, "done": done or epoch + 1 == opts.epochs,
                             "model": model.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
                             "torch_rng": torch.get_rng_state()})  # fmt: skip
        if done:
            break
        model.train()
    model.eval()
    return history


def _optimizer(model, opts: SFTConfig, total_steps: int):
    """AdamW at `opts.lr` and its schedule, stepped once per batch: a linear warmup over `opts.warmup_steps`, then
    `opts.schedule` (linear: down to 10 % at `total_steps`; constant). Checks `opts` (the `sft` keys) on the way."""
    optim = torch.optim.AdamW(model.parameters(), lr=opts.lr, weight_decay=0.0)
    warmup = max(1, opts.warmup_steps)
    validate_sft(opts, "sft")
    decay = (lambda s: max(0.1, 1 - s / total_steps)) if opts.schedule == "linear" else (lambda s: 1.0)
    return optim, torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / warmup) * decay(s))


def _resume(
    saved: dict, model, optim, sched, checkpoint: EpochCheckpoint, rng: random.Random, batches: list
) -> tuple[list[float], int]:
    """Load a saved epoch's state into the training objects and replay the batch order of the epochs done (`rng`
    shuffles `batches` as they did); returns (losses so far, epochs done)."""
    model.load_state_dict(saved["model"])
    optim.load_state_dict(saved["optim"])
    sched.load_state_dict(saved["sched"])
    torch.set_rng_state(saved["torch_rng"])
    checkpoint.load_extra(saved["extra"])
    history, start = list(saved["history"]), int(saved["epoch"])
    for _ in range(start):  # the batch order of the epochs done: the same shuffles, replayed
        rng.shuffle(batches)
    logger.info("sft: resumed from %s after epoch %d (losses %s)", checkpoint.path, start, history)
    return history, start


def save_hf(model, tokenizer, out_dir: str, extra_files: dict[str, str] | None = None) -> str:
    """Write model + tokenizer (+ `extra_files`: name -> text) as a HF directory atomically (temp dir, rename)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-sft-", dir=parent)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for name, text in (extra_files or {}).items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def load_policy(cfg: RSearchConfig, seed: int | None = None):
    """The policy to fine-tune (model.path, ignoring model.sft_checkpoint) as float32 masters, and its tokenizer with
    the protocol's special tokens; a tiny policy is initialised from `seed` (default: cfg.seed)."""

    tokenizer = policy_tokenizer(cfg)
    model_cfg = dataclasses.replace(cfg.model, sft_checkpoint=None)
    return load_model(model_cfg, tokenizer, seed=cfg.seed if seed is None else seed, dtype=torch.float32), tokenizer


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m rsearch_verl.sft", description=__doc__.split("\n\n")[0])
    parser.add_argument("--demos", required=True, help="JSONL demonstrations ({prompt, segments})")
    parser.add_argument("--out", required=True)
    for field in dataclasses.fields(SFTConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(overrides)
    opts = SFTConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SFTConfig)})
    with open(args.demos) as f:
        demos = [json.loads(line) for line in f if line.strip()]
    model, tokenizer = load_policy(cfg)
    train_sft(model, tokenizer, demos, opts, dtype=getattr(torch, cfg.model.dtype))
    return save_hf(model, tokenizer, args.out)


if __name__ == "__main__":
    from rsearch_verl.log_setup import setup_logging

    setup_logging()
    main()
