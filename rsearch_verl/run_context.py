"""What a run resolves while it starts, kept apart from the validated (frozen) recipe config.

A recipe's config is validated once and then frozen (rsearch_verl/config.py). Some values only exist once the run
is starting: the toy world's tokenizer (trained for the tiny policy), the warm start (`model.sft_checkpoint=auto`,
trained or found in the cache), the URL of the retrieval server the run started, and for eval the checkpoint under
evaluation. They live in a `RunContext`; `RunContext.apply` derives the run's config from the recipe's config and
them -- the one place this happens -- and validates (so freezes) the result. That derived config is what the
workers receive (as `to_dict(cfg)`) and what the run directory's config.yaml records.

Usage:
    ctx = RunContext(tokenizer_path=data.tokenizer_path)
    ctx = dataclasses.replace(ctx, sft_checkpoint=warm_start(ctx.apply(cfg)))
    run_cfg = dataclasses.replace(ctx, retriever_url=url).apply(cfg)
"""

from __future__ import annotations

import dataclasses

from rsearch_verl.config import RSearchConfig, validate


@dataclasses.dataclass(frozen=True)
class RunContext:
    # the toy world's own tokenizer; used only when the recipe leaves model.tokenizer_path unset
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
        if self.tokenizer_path is not None and cfg.model.tokenizer_path is None:
            model["tokenizer_path"] = self.tokenizer_path
        if self.sft_checkpoint is not None:
            model["sft_checkpoint"] = self.sft_checkpoint
        changes: dict = {"model": dataclasses.replace(cfg.model, **model)} if model else {}
        if self.retriever_url is not None:
            changes["retriever"] = dataclasses.replace(cfg.retriever, url=self.retriever_url)
        return validate(dataclasses.replace(cfg, **changes)) if changes else cfg
