"""Rollout engines behind one async interface (`base.RolloutEngine`): Hugging Face (CPU default) and vLLM.

    engine = make_engine(cfg.rollout, model, tokenizer, device="cpu")   # cfg.rollout.engine: "hf" | "vllm"
    out = await engine.generate(prompt_ids, SamplingParams(...), stop=protocol.stop_strings)

vLLM is imported only when `rollout.engine == "vllm"` (this package imports without GPU libraries).
"""

from __future__ import annotations

from rsearch_verl.config import RolloutConfig
from rsearch_verl.rollout.engines.base import GenerationResult, RolloutEngine, SamplingParams


def make_engine(rollout_cfg: RolloutConfig, model, tokenizer, device: str = "cpu") -> RolloutEngine:
    """The engine named by `rollout_cfg.engine`, holding (HF) or initialised from (vLLM) `model`'s weights."""
    if rollout_cfg.engine == "hf":
        from rsearch_verl.rollout.engines.hf import HFEngine

        return HFEngine(model, tokenizer, device=device, max_batch=max(1, rollout_cfg.max_concurrent_trajectories))
    if rollout_cfg.engine == "vllm":
        from rsearch_verl.rollout.engines.vllm import VLLMEngine

        return VLLMEngine.from_model(rollout_cfg, model, tokenizer, device=device)
    raise ValueError(f"rollout.engine: unknown engine {rollout_cfg.engine!r}; known: hf, vllm")


__all__ = ["GenerationResult", "RolloutEngine", "SamplingParams", "make_engine"]
