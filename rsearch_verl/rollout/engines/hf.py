"""Hugging Face transformers rollout engine (the CPU default): token-in / token-out, continuously batched, seeded.

Concurrent `generate` calls (from many trajectories on one or several event loops) go into a thread-safe queue; a
background thread decodes them with a KV cache in one left-padded batch. The batch is continuous: between two decode
steps, newly arrived requests are prefilled and joined to the running batch (both caches left-padded to one width),
and every row that finishes is resolved at once and leaves the batch (the cache is re-indexed and columns that are
padding in every remaining row are dropped). So a trajectory that stops at `</search>` goes to the retriever while
the others keep decoding, and rejoins as soon as its observation is appended — nobody waits for the slowest row.
The KV cache is a preallocated buffer per layer (`_GrowingLayer`): a decode step writes its column in place, a join
costs one copy. Continuous batching is the default; `continuous=False` runs each gathered batch to the end (finished
rows still leave the cache early). Measured with benchmarks/rollout_async.py (long-tailed turn lengths, 2-core CPU):
the async agent loop took 2.5-2.9 s continuous vs 4.0 s static; a turn-synchronous loop is the same either way.
Models whose cache is not a plain DynamicCache (sliding-window layers) are never joined into: new requests wait
until the running batch drains.

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
from transformers.cache_utils import DynamicLayer

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
    """log-probs [..., V] of the sampling distribution of each row (temperature, top-k, top-p); raw when greedy."""
    logits = logits.float()
    if sampling.temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= sampling.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
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


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys / values are views of a buffer [B, heads, capacity, head_dim] with room to grow.

    DynamicLayer appends by `torch.cat` of the whole cache, an O(B x S) copy per decode step and layer, which made a
    wide continuous batch cost more per step than a narrow one; here a step writes its column in place and the
    buffer is reallocated (with spare room) only when full, on a join, or when rows leave."""

    def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int):
        super().__init__()
        self.is_initialized = True
        self.dtype, self.device = kbuf.dtype, kbuf.device
        self._kbuf, self._vbuf, self.length = kbuf, vbuf, length
        self._view()

    @classmethod
    def merged(cls, parts: list[DynamicLayer], width: int) -> _GrowingLayer:
        """One layer holding `parts` stacked along the batch, each right-aligned to `width` columns."""
        rows = sum(p.keys.shape[0] for p in parts)
        _, h, _, d = parts[0].keys.shape
        kbuf = parts[0].keys.new_zeros((rows, h, width + _spare(width), d))
        vbuf = torch.zeros_like(kbuf)
        at = 0
        for p in parts:
            n, s = p.keys.shape[0], p.keys.shape[2]
            kbuf[at : at + n, :, width - s : width] = p.keys
            vbuf[at : at + n, :, width - s : width] = p.values
            at += n
        return cls(kbuf, vbuf, width)

    def _view(self) -> None:
        self.keys, self.values = self._kbuf[:, :, : self.length], self._vbuf[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[2]
        if end > self._kbuf.shape[2]:  # full: reallocate with room (amortised; a step never copies the cache)
            self._kbuf, self._vbuf = (self._grown(buf, end + _spare(end)) for buf in (self._kbuf, self._vbuf))
        self._kbuf[:, :, self.length : end] = key_states
        self._vbuf[:, :, self.length : end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def _grown(self, buf: torch.Tensor, capacity: int) -> torch.Tensor:
        out = buf.new_zeros((*buf.shape[:2], capacity, buf.shape[3]))
        out[:, :, : self.length] = buf[:, :, : self.length]
        return out

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._kbuf, self._vbuf = self._kbuf[indices], self._vbuf[indices]
        self._view()

    def drop_left(self, n: int) -> None:
        """Forget the first `n` columns (padding in every live row)."""
        self._kbuf, self._vbuf = self._kbuf[:, :, n:], self._vbuf[:, :, n:]
        self.length -= n
        self._view()


def _spare(width: int) -> int:
    return max(64, width // 2)


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
        self, model, tokenizer, device: str = "cpu", gather_ms: float = 3.0, max_batch: int = 64, continuous=True
    ):
        self.continuous = continuous  # join requests mid-decode (see module docstring); off: batch to the end
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
        # model forwards since start (written by the worker thread only; benchmarks read differences):
        # decode steps, rows decoded (= tokens fed), key/value columns attended incl. padding, prefill forwards
        self.counters = {"decode_steps": 0, "decode_rows": 0, "decode_kv_cols": 0, "prefills": 0}
        self._token_text: dict[int, str] = {}  # token id -> its text alone (the stop-string pre-check)
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
        is resolved at once (its trajectory searches while the others keep decoding)."""
        if not self.continuous:
            super()._worker()
            return
        batch: _Batch | None = None
        stopping = False
        while True:
            live = len(batch.rows) if batch is not None else 0
            if live == 0 and stopping:
                return
            joinable = live == 0 or all(isinstance(layer, _GrowingLayer) for layer in batch.past.layers)
            room = self.max_batch - live if joinable else 0
            new, stop = self._take(block=live == 0, room=room) if not stopping else ([], False)
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
        self.counters["prefills"] += 1
        past = out.past_key_values
        if all(type(layer) is DynamicLayer for layer in past.layers):  # else (sliding window...): as the model made it
            past.layers = [_GrowingLayer.merged([layer], width) for layer in past.layers]
        batch = _Batch(rows, past, attn, pos[:, -1], out.logits[:, -1, :])
        batch.started = list(rows)
        for row in rows:
            row.peak = len(rows)
        return batch

    def _join(self, batch: _Batch | None, new: _Batch) -> _Batch:
        """Append `new` rows to the running batch: one cache buffer, both parts right-aligned to one width (attention
        mask 0 on the left padding); one copy per join, none per decode step."""
        if batch is None or not batch.rows:
            return new
        if not all(isinstance(layer, _GrowingLayer) for layer in batch.past.layers):
            raise RuntimeError("continuous batching needs a plain DynamicCache (no sliding-window layers)")
        width = max(batch.attn.shape[1], new.attn.shape[1])
        for i, (old, add) in enumerate(zip(batch.past.layers, new.past.layers, strict=True)):
            batch.past.layers[i] = _GrowingLayer.merged([old, add], width)
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
        next_ids = self._choose(batch.rows, batch.logits)
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
                if isinstance(layer, _GrowingLayer):
                    layer.drop_left(first)
                else:
                    layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            batch.attn = batch.attn[:, first:]
        return done

    def _advance(self, batch: _Batch) -> None:
        """Feed each live row's newest token; the batch then holds the next logits."""
        batch.attn = torch.cat([batch.attn, batch.attn.new_ones((len(batch.rows), 1))], dim=1)
        batch.last_pos = batch.last_pos + 1
        self.counters["decode_steps"] += 1
        self.counters["decode_rows"] += len(batch.rows)
        self.counters["decode_kv_cols"] += batch.attn.numel()
        out = self.model(
            input_ids=torch.tensor(batch.pending, device=self.device).unsqueeze(1),
            attention_mask=batch.attn,
            position_ids=batch.last_pos.unsqueeze(1),
            past_key_values=batch.past,
            use_cache=True,
        )
        batch.logits, batch.past = out.logits[:, -1, :], out.past_key_values

    def _choose(self, rows: list[_Row], logits: torch.Tensor) -> list[int]:
        """Next token of every row (forced, greedy or sampled with the row's generator), recorded on the row. The
        log-probs of rows that share sampling settings are computed as one batch, not row by row."""
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(rows):
            s = row.req.sampling
            groups.setdefault((s.temperature, s.top_k, s.top_p), []).append(i)
        if len(groups) == 1:
            logp = filtered_logprobs(logits, rows[0].req.sampling)
        else:
            logp = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
            for index in groups.values():
                at = torch.tensor(index, device=logits.device)
                logp[at] = filtered_logprobs(logits[at], rows[index[0]].req.sampling)
        greedy = logp.argmax(-1).tolist()
        tokens = []
        for i, row in enumerate(rows):
            n = len(row.tokens)
            if n < len(row.forced):
                tokens.append(row.forced[n])
            elif row.req.sampling.temperature == 0:
                tokens.append(greedy[i])
            else:
                tokens.append(int(torch.multinomial(logp[i].exp().cpu(), 1, generator=row.generator)))
        chosen = logp[torch.arange(len(rows), device=logp.device), torch.tensor(tokens, device=logp.device)]
        for row, token, lp in zip(rows, tokens, chosen.tolist(), strict=True):
            self._record(row, token, lp)
        return tokens

    def _record(self, row: _Row, token: int, logprob: float) -> None:
        """Append the row's token and decide whether the row is finished."""
        row.tokens.append(token)
        row.logprobs.append(logprob)
        if token in self.eos_ids:
            row.finish = "eos"
        elif row.req.stop and self._may_complete(token, row.req.stop) and (hit := self._stop_hit(row)) is not None:
            row.finish, row.stop_string = "stop", hit
        elif len(row.tokens) >= row.req.sampling.max_tokens:
            row.finish = "length"

    def _may_complete(self, token: int, stop: list[str]) -> bool:
        """Whether `token` can be the last piece of a stop string: its text holds a stop string's last character (or
        is a partial UTF-8 byte). Skips decoding the tail window for the vast majority of tokens."""
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return "\ufffd" in text or any(s[-1] in text for s in stop if s)

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
