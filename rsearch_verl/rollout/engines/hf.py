"""Hugging Face transformers rollout engine (the CPU default): token-in / token-out, continuously batched, seeded.

Concurrent `generate` calls (from many trajectories on one or several event loops) go into a thread-safe queue; a
background thread decodes them with a KV cache in one left-padded batch. The batch is continuous: between two decode
steps, newly arrived requests are prefilled and joined to the running batch (both caches left-padded to one width),
and every row that finishes is resolved at once and leaves the batch (the cache is re-indexed and columns that are
padding in every remaining row are dropped). So a trajectory that stops at `</search>` goes to the retriever while
the others keep decoding, and rejoins as soon as its observation is appended — nobody waits for the slowest row.
Continuous joining is opt-in (`continuous=True`): measured on the 2-core CPU box with benchmarks/rollout_async.py it
was slower than plain batches (each join is a separate small prefill plus a full cache copy); the default runs each
gathered batch to the end, finished rows leaving the cache early.

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
    if fut.done():  # cancelled by its caller, or already answered
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
        self.start = time.perf_counter()
        self.peak = 1  # the largest batch this row decoded in
        if req.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(int(req.sampling.seed))


@dataclass
class _Batch:
    """The running decode batch: live rows and their KV cache, attention mask [B, S], positions, next logits."""

    rows: list[_Row]
    past: object  # transformers DynamicCache, [B, heads, S, head_dim] per layer
    attn: torch.Tensor
    last_pos: torch.Tensor
    logits: torch.Tensor
    pending: list[int] = field(default_factory=list)  # sampled, not yet fed
    started: list[_Row] = field(default_factory=list)  # every row that ever joined, in order


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _result(row: _Row) -> GenerationResult:
    return GenerationResult(row.tokens, row.logprobs, row.finish, row.stop_string)


def _deliver(row: _Row, result: GenerationResult) -> None:
    now = time.perf_counter()
    result.timing.update(queue_s=row.start - row.req.enqueued, batch_s=now - row.start, batch_size=float(row.peak))
    row.req.loop.call_soon_threadsafe(_resolve, row.req.future, result)


class HFEngine(BatchingEngine):
    """A transformers CausalLM behind the RolloutEngine interface (batched KV-cache decoding, any device)."""

    def __init__(
        self, model, tokenizer, device: str = "cpu", gather_ms: float = 3.0, max_batch: int = 64, continuous=False
    ):
        self.continuous = continuous  # join requests mid-decode (see module docstring); off: batch to the end
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
        """Decode `requests` together to the end (no joining); the worker thread uses the continuous loop below."""
        batch = self._prefill(requests)
        while batch.rows:
            self._sample(batch)
            if batch.rows:
                self._advance(batch)
        return [_result(r) for r in batch.started]

    def _worker(self) -> None:
        """Continuous batching: new requests join the running batch between decode steps, and every finished row
        is resolved at once (its trajectory searches while the others keep decoding). Off by default: on the CPU
        benchmark the per-join prefill and cache copies cost more than they saved (see the module docstring)."""
        if not self.continuous:
            super()._worker()
            return
        batch: _Batch | None = None
        stopping = False
        while True:
            live = len(batch.rows) if batch is not None else 0
            if live == 0 and stopping:
                return
            new, stop = self._take(block=live == 0, room=self.max_batch - live) if not stopping else ([], False)
            stopping = stopping or stop
            try:
                with self._lock, torch.no_grad():
                    if new:
                        batch = self._join(batch, self._prefill(new))
                    if batch is None or not batch.rows:
                        continue
                    for row in self._sample(batch):
                        _deliver(row, _result(row))
                    if batch.rows:
                        self._advance(batch)
            except Exception as exc:  # noqa: BLE001 - every waiting caller must hear about the failure
                logger.exception("rollout engine step failed")
                failed = {id(r.req): r.req for r in (batch.rows if batch is not None else [])}
                failed.update({id(r): r for r in new})
                for req in failed.values():
                    req.loop.call_soon_threadsafe(_resolve, req.future, None, exc)
                batch = None

    def _take(self, block: bool, room: int) -> tuple[list[Request], bool]:
        """Pending requests (at most `room`): wait for the first one only when nothing is decoding."""
        if room <= 0:
            return [], False
        if block:
            first = self._queue.get()
            if first is _STOP:
                return [], True
            batch, stop = self._gather(first)
            return batch[:room], stop  # _gather stops at max_batch == room when idle
        taken: list[Request] = []
        while len(taken) < room:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                return taken, True
            taken.append(item)
        return taken, False

    def _prefill(self, requests: list[Request]) -> _Batch:
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
        batch = _Batch(rows, out.past_key_values, attn, pos[:, -1], out.logits[:, -1, :])
        batch.started = list(rows)
        for row in rows:
            row.peak = len(rows)
        return batch

    def _join(self, batch: _Batch | None, new: _Batch) -> _Batch:
        """Append `new` rows to the running batch: both caches left-padded to one width (attention mask 0 there)."""
        if batch is None or not batch.rows:
            return new
        if not all(type(layer).__name__ == "DynamicLayer" for layer in batch.past.layers):
            raise RuntimeError("continuous batching needs a plain DynamicCache (no sliding-window layers)")
        width = max(batch.attn.shape[1], new.attn.shape[1])
        for old, add in zip(batch.past.layers, new.past.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width, 2), _left_pad(add.keys, width, 2)])
            old.values = torch.cat([_left_pad(old.values, width, 2), _left_pad(add.values, width, 2)])
        batch.attn = torch.cat([_left_pad(batch.attn, width, 1), _left_pad(new.attn, width, 1)])
        batch.last_pos = torch.cat([batch.last_pos, new.last_pos])
        batch.logits = torch.cat([batch.logits, new.logits])
        batch.rows += new.rows
        batch.started += new.rows
        for row in batch.rows:
            row.peak = max(row.peak, len(batch.rows))
        return batch

    def _sample(self, batch: _Batch) -> list[_Row]:
        """One token for every live row; finished rows leave the batch (and its cache) and are returned."""
        next_ids = [self._step(row, batch.logits[i]) for i, row in enumerate(batch.rows)]
        keep = [i for i, row in enumerate(batch.rows) if row.finish is None]
        done = [row for row in batch.rows if row.finish is not None]
        batch.pending = [next_ids[i] for i in keep]
        if not done:
            return done
        batch.rows = [batch.rows[i] for i in keep]
        if not keep:
            return done
        index = torch.tensor(keep, device=self.device)
        batch.past.batch_select_indices(index)
        batch.attn, batch.last_pos = batch.attn[index], batch.last_pos[index]
        first = int(batch.attn.any(0).nonzero()[0])  # columns that are padding in every live row: drop them
        if first > 0:
            for layer in batch.past.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            batch.attn = batch.attn[:, first:]
        return done

    def _advance(self, batch: _Batch) -> None:
        """Feed each live row's newest token; the batch then holds the next logits."""
        batch.attn = torch.cat([batch.attn, batch.attn.new_ones((len(batch.rows), 1))], dim=1)
        batch.last_pos = batch.last_pos + 1
        out = self.model(
            input_ids=torch.tensor(batch.pending, device=self.device).unsqueeze(1),
            attention_mask=batch.attn,
            position_ids=batch.last_pos.unsqueeze(1),
            past_key_values=batch.past,
            use_cache=True,
        )
        batch.logits, batch.past = out.logits[:, -1, :], out.past_key_values

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
