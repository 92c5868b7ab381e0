"""What a run resolves while it starts, kept apart from the validated (frozen) recipe config.

A recipe's config is validated once and then frozen (rsearch_verl/config/). Some values only exist once the run
is starting: the toy world's tokenizer (trained for the tiny policy), the warm start (`model.sft_checkpoint=auto`,
trained or found in the cache), the URL of the retrieval server the run started, and for eval the checkpoint under
evaluation. They live in a `RunContext`; `RunContext.apply` derives the run's config from the recipe's config and
them -- the one place this happens -- and validates (so freezes) the result. That derived config is what the
workers receive (as `to_dict(cfg)`) and what the run directory's config.yaml records.

What the run resolved itself (the toy tokenizer, the warm start) is built in the driver's cache, on the driver's disk;
on a cluster of several hosts the workers cannot read it there. `published(run_dir)` copies those directories into
the run directory (`<run_dir>/published/`), which every host must see, and points the context at the copies: the
config the workers receive never names a path on the driver's private disk. A copy is made in a temporary directory
inside the run directory and renamed into place, so a worker never sees half a copy, and a resumed run reuses it.

Usage:
    ctx = RunContext(tokenizer_path=data.tokenizer_path)
    ctx = dataclasses.replace(ctx, sft_checkpoint=warm_start(ctx.apply(cfg)))
    run_cfg = dataclasses.replace(ctx, retriever_url=url).published(run_dir).apply(cfg)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile

from rsearch_verl.config import RSearchConfig, validate

logger = logging.getLogger(__name__)

PUBLISHED = "published"  # under the run directory


@dataclasses.dataclass(frozen=True)
class RunContext:
    # the toy world's own tokenizer; used only when the recipe leaves model.tokenizer_path unset (and model.family is
    # qwen2)
    tokenizer_path: str | None = None
    # the warm start's HF directory (what model.sft_checkpoint=auto resolved to), or any SFT checkpoint
    sft_checkpoint: str | None = None
    # the retrieval server this run uses (its own, started for it, or the recipe's external retriever.url)
    retriever_url: str | None = None
    # eval: the checkpoint under evaluation is the model (model.path), not the recipe's warm start
    model_path: str | None = None

    def apply(self, cfg: RSearchConfig) -> RSearchConfig:
        """`cfg` with the resolved values filled in: a new config, validated and frozen; `cfg` is unchanged."""
        model: dict = {}
        if self.model_path is not None:
            model.update(path=self.model_path, sft_checkpoint=None)
        # the toy world's tokenizer is a ChatML BPE, the tiny qwen2 policy's; the other families keep their own
        # (special tokens and chat template: rsearch_verl/model_families.py)
        if self.tokenizer_path is not None and cfg.model.tokenizer_path is None and cfg.model.family in (None, "qwen2"):
            model["tokenizer_path"] = self.tokenizer_path
        if self.sft_checkpoint is not None:
            model["sft_checkpoint"] = self.sft_checkpoint
        changes: dict = {"model": dataclasses.replace(cfg.model, **model)} if model else {}
        if self.retriever_url is not None:
            changes["retriever"] = dataclasses.replace(cfg.retriever, url=self.retriever_url)
        return validate(dataclasses.replace(cfg, **changes)) if changes else cfg

    def published(self, run_dir: str) -> RunContext:
        """This context with its own files (tokenizer_path, sft_checkpoint) copied into `<run_dir>/published/`, where
        every host of the cluster sees them (the run directory must be shared), and the paths pointing there."""
        changes = {
            field: publish(path, run_dir, field)
            for field in ("tokenizer_path", "sft_checkpoint")
            if (path := getattr(self, field)) is not None
        }
        return dataclasses.replace(self, **changes) if changes else self


def publish(src: str, run_dir: str, kind: str) -> str:
    """`src` (a directory) copied to `<run_dir>/published/<kind>-<name of src>` unless it is there already (the
    names carry the cache keys); atomic: copied to a temporary directory beside it, then renamed."""
    src = os.path.abspath(src)
    root = os.path.join(os.path.abspath(run_dir), PUBLISHED)
    if src.startswith(root + os.sep):
        return src
    dst = os.path.join(root, f"{kind}-{os.path.basename(src.rstrip(os.sep))}")
    if os.path.isdir(dst):
        return dst
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        os.rename(tmp, dst)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(dst):  # another publisher's rename won the race: theirs is the same files
            raise
    logger.info("published %s %s -> %s (the run directory every host sees)", kind, src, dst)
    return dst


def check_checkpoint_tokenizer(tokenizer_path: str | None, checkpoint: str | None) -> None:
    """Refuse an SFT checkpoint whose own tokenizer is not the run's: its token ids would mean other words to it.

    The toy world's tokenizer is trained where the run starts; another version of `tokenizers` can train a different
    one from the same world (seen: 2358 tokens on a GPU machine, 2361 on the CPU machine that built the warm start), so
    a warm start carried from another machine must be rebuilt there. Only directories that both hold a tokenizer.json
    are compared."""
    files = [os.path.join(path, "tokenizer.json") for path in (tokenizer_path, checkpoint) if path]
    if len(files) < 2 or not all(os.path.isfile(f) for f in files):
        return
    vocab = []
    for path in files:
        with open(path) as f:
            vocab.append(json.load(f).get("model", {}).get("vocab"))
    if vocab[0] != vocab[1]:
        raise ValueError(
            f"model.sft_checkpoint={checkpoint} was trained with another tokenizer than the run's "
            f"({len(vocab[1] or {})} vs {len(vocab[0] or {})} tokens at {tokenizer_path}): a toy world's tokenizer is "
            "trained where the run starts, and another tokenizers version trains another one; build the warm start "
            "on this machine (model.sft_checkpoint=auto) or run where it was built"
        )
