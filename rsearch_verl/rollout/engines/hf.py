"""Hugging Face transformers rollout engine (the CPU default): token-in / token-out, batched, seeded.

Concurrent `generate` calls (from many trajectories on one or several event loops) go into a thread-safe queue; a
background thread gathers whatever is pending (a few ms window), runs one left-padded batched decode with a KV
cache, and resolves each caller's future. Finished rows leave the batch (the cache is re-indexed), so a batch
costs what its live rows cost.

    engine = HFEngine(model, tokenizer)
    out = await engine.generate(ids, SamplingParams(temperature=1.0, max_tokens=64, seed=7), stop=["</search>"])
    engine.load_weights(actor_state_dict)    # HF parameter names
    engine.close()

Semantics (shared with the vLLM engine): the returned tokens end with the token that completes a stop string (or
EOS) and nothing after it; `logprobs` are log p(token) under the sampling distribution (temperature-scaled,
top-k / top-p applied; raw model distribution when greedy, temperature == 0); `SamplingParams.seed` makes a call
reproducible (one torch.Generator per request).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from rsearch_verl.rollout.engines.base import GenerationResult, RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)

_STOP = object()  # queue sentinel: the worker thread exits


@dataclass
class Request:
    """One pending `generate` call; resolved on the caller's event loop."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


def _resolve(fut: asyncio.Future, result=None, exc: BaseException | None = None) -> None:
    if fut.cancelled():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def check_request(prompt_ids: list[int], sampling: SamplingParams) -> None:
    if not prompt_ids:
        raise ValueError("generate(): prompt_ids is empty")
    if sampling.max_tokens < 1:
        raise ValueError(f"generate(): max_tokens must be >= 1, got {sampling.max_tokens}")
    if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
        raise ValueError(f"generate(): bad temperature {sampling.temperature} / top_p {sampling.top_p}")


class BatchingEngine(RolloutEngine):
    """Queue + background thread that batches concurrent requests; subclasses implement `run_batch`."""

    def __init__(self, gather_ms: float = 3.0, max_batch: int = 64):
        self.gather_s = gather_ms / 1000.0
        self.max_batch = max_batch
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.RLock()  # weights never change under a running batch (re-entered by run_batch)
        self._thread = threading.Thread(target=self._worker, name=f"{type(self).__name__}-batcher", daemon=True)
        self._closed = False
        self._thread.start()

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, stop: list[str]) -> GenerationResult:
        check_request(prompt_ids, sampling)
        if self._closed:
            raise RuntimeError("engine is closed")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put(Request(list(map(int, prompt_ids)), sampling, list(stop), loop, fut))
        return await fut

    def run_batch(self, requests: list[Request]) -> list[GenerationResult]:
        raise NotImplementedError

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join(timeout=30)

    def _gather(self, first: Request) -> tuple[list[Request], bool]:
        batch, stop = [first], False
        while len(batch) < self.max_batch:
            try:
                item = self._queue.get(timeout=self.gather_s)
            except queue.Empty:
                break
            if item is _STOP:
                stop = True
                break
            batch.append(item)
        return batch, stop

    def _worker(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch, stop = self._gather(first)
            start = time.perf_counter()
            try:
                with self._lock:
                    results = self.run_batch(batch)
            except Exception as exc:  # noqa: BLE001 - every caller must hear about the failure
                logger.exception("rollout engine batch of %d failed", len(batch))
                for req in batch:
                    req.loop.call_soon_threadsafe(_resolve, req.future, None, exc)
            else:
                for req, res in zip(batch, results, strict=True):
                    res.timing.update(queue_s=start - req.enqueued, batch_s=time.perf_counter() - start)
                    res.timing["batch_size"] = float(len(batch))
                    req.loop.call_soon_threadsafe(_resolve, req.future, res)
            if stop:
                return


def filtered_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """log-probs [V] of the sampling distribution of one row (temperature, top-k, top-p); raw when greedy."""
    logits = logits.float()
    if sampling.temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= sampling.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.log_softmax(logits, dim=-1)


class _Row:
    """Decode state of one request inside a batch."""

    def __init__(self, req: Request, forced: list[int] | None):
        self.req = req
        self.forced = forced or []
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str | None = None
        self.stop_string: str | None = None
        self.generator = None
        if req.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(int(req.sampling.seed))


class HFEngine(BatchingEngine):
    """A transformers CausalLM behind the RolloutEngine interface (batched KV-cache decoding, any device)."""

    def __init__(self, model, tokenizer, device: str = "cpu", gather_ms: float = 3.0, max_batch: int = 64):
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
        super().__init__(gather_ms=gather_ms, max_batch=max_batch)

    # ---- weights ----------------------------------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        unknown = [k for k in state_dict if k not in own]
        if unknown:
            raise KeyError(f"load_weights: {len(unknown)} unknown parameter names, e.g. {unknown[:3]}")
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        missing = [k for k in own if k not in state_dict and not (tied and k == "lm_head.weight")]
        if missing:
            raise KeyError(f"load_weights: {len(missing)} parameters missing, e.g. {missing[:3]}")
        with self._lock, torch.no_grad():
            for name, tensor in state_dict.items():
                own[name].copy_(tensor.to(device=own[name].device, dtype=own[name].dtype))

    # ---- hooks ------------------------------------------------------------------------------------------------
    def forced_tokens(self, prompt_ids: list[int]) -> list[int] | None:
        """Token ids this request must emit first (none here; scripted test / benchmark engines override it)."""
        return None

    # ---- decoding ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def run_batch(self, requests: list[Request]) -> list[GenerationResult]:
        rows = [_Row(r, self.forced_tokens(r.prompt_ids)) for r in requests]
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attn[i, width - len(r.prompt_ids) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        logits, past = out.logits[:, -1, :], out.past_key_values
        live = list(range(len(rows)))  # batch position -> row index
        last_pos = pos[:, -1]
        while True:
            next_ids = [self._step(rows[r], logits[b]) for b, r in enumerate(live)]
            keep = [b for b, r in enumerate(live) if rows[r].finish is None]
            if not keep:
                break
            if len(keep) < len(live):  # drop finished rows from the cache: a batch costs only its live rows
                index = torch.tensor(keep, device=self.device)
                past.batch_select_indices(index)
                attn, last_pos = attn[index], last_pos[index]
                next_ids = [next_ids[b] for b in keep]
                live = [live[b] for b in keep]
            attn = torch.cat([attn, attn.new_ones((len(live), 1))], dim=1)
            last_pos = last_pos + 1
            step_ids = torch.tensor(next_ids, device=self.device).unsqueeze(1)
            out = self.model(
                input_ids=step_ids,
                attention_mask=attn,
                position_ids=last_pos.unsqueeze(1),
                past_key_values=past,
                use_cache=True,
            )
            logits, past = out.logits[:, -1, :], out.past_key_values
        return [
            GenerationResult(token_ids=r.tokens, logprobs=r.logprobs, finish_reason=r.finish, stop_string=r.stop_string)
            for r in rows
        ]

    def _step(self, row: _Row, logits: torch.Tensor) -> int:
        """Pick the row's next token, record it, and decide whether the row is finished."""
        sampling = row.req.sampling
        logp = filtered_logprobs(logits, sampling)
        n = len(row.tokens)
        if n < len(row.forced):
            token = row.forced[n]
        elif sampling.temperature == 0:
            token = int(torch.argmax(logp))
        else:
            token = int(torch.multinomial(logp.exp().cpu(), 1, generator=row.generator))
        row.tokens.append(token)
        row.logprobs.append(float(logp[token]))
        if token in self.eos_ids:
            row.finish = "eos"
        elif row.req.stop and (hit := self._stop_hit(row)) is not None:
            row.finish, row.stop_string = "stop", hit
        elif len(row.tokens) >= sampling.max_tokens:
            row.finish = "length"
        return token

    def _stop_hit(self, row: _Row) -> str | None:
        # only the newest token can complete a stop string (earlier ones were checked at their own step), so a
        # tail window long enough to hold the longest stop string is all that needs decoding
        window = 2 * max(len(s) for s in row.req.stop) + 2
        tail = self.tokenizer.decode(row.tokens[-window:], skip_special_tokens=False)
        hits = [(tail.find(s), s) for s in row.req.stop if s and s in tail]
        return min(hits)[1] if hits else None


class ScriptedHFEngine(HFEngine):
    """The real HF engine whose first tokens of each turn are forced from a script (tests, benchmarks, demos).

    A tiny random model never writes `<search>` by itself; `script(context_text)` returns the text the policy must
    write next (or None: sample freely). The forced ids go through the same decode loop, stop-string check,
    logprob and GenerationResult path as sampled ones, and once the script runs out the model samples on.
    """

    def __init__(self, model, tokenizer, script, **kwargs):
        self.script = script
        super().__init__(model, tokenizer, **kwargs)

    def forced_tokens(self, prompt_ids: list[int]) -> list[int] | None:
        text = self.script(self.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        return None if text is None else self.tokenizer.encode(text, add_special_tokens=False)
