"""Hugging Face transformers rollout engine (the CPU default): token-in / token-out, continuously batched, seeded.

Concurrent `generate` calls (from many trajectories on one or several event loops) go into a thread-safe queue; a
background thread decodes them with a KV cache in one left-padded batch. The batch is continuous: between two decode
steps, newly arrived requests are prefilled and joined to the running batch (both caches left-padded to one width),
and every row that finishes is resolved at once and leaves the batch (the cache is re-indexed and columns that are
padding in every remaining row are dropped). So a trajectory that stops at `</search>` goes to the retriever while
the others keep decoding, and rejoins as soon as its observation is appended — nobody waits for the slowest row.
The KV cache is a preallocated buffer per layer (rsearch_verl/rollout/engines/kv_cache.py): a decode step writes
its column in place, a join costs one copy. Continuous batching is the default; `continuous=False` runs each gathered
batch to the end (finished rows still leave the cache early); benchmarks/rollout_async.py compares the two.
Hybrid models (Qwen3.5 / 3.6) join too: their linear-attention layers keep a recurrent and a conv state per row
(kv_cache.py's RecurrentLayer), joined by row. Models with other cache layers (sliding window) are never joined
into: new requests wait until the running batch drains. Every call prefills its whole prompt (no prefix reuse across
calls): after an observation, a hybrid's recurrent state is re-derived from the full context, never carried over.
Weight updates land between two decode steps (rsearch_verl/rollout/engines/batching.py); rows decoding across one
keep their KV cache (computed by the older weights) and tag each token with the version that sampled it. The model
lives in this engine on its device and stays there: `sleep` / `wake_up` only track the state (base.py), since the HF
engine is the CPU path, where offloading would gain nothing.

    engine = HFEngine(model, tokenizer)
    out = await engine.generate(ids, SamplingParams(temperature=1.0, max_tokens=64, seed=7), stop=["</search>"])
    engine.load_weights(actor_state_dict, version=1)    # HF parameter names (or a stream of (name, tensor) pairs)
    engine.close()

Semantics (shared with the vLLM engine): the returned tokens end with the token that completes a stop string (or
EOS) and nothing after it; `logprobs` are log p(token) under the sampling distribution (temperature-scaled,
top-k / top-p applied; raw model distribution when greedy, temperature == 0); `SamplingParams.seed` makes a call
reproducible (one torch.Generator per request).
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, field

import torch

from rsearch_verl.rollout.engines.base import GenerationResult, SamplingParams
from rsearch_verl.rollout.engines.batching import BatchingEngine, Request, resolve
from rsearch_verl.rollout.engines.kv_cache import growing, joinable, left_pad, merged

logger = logging.getLogger(__name__)


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

    def __init__(self, req: Request):
        self.req = req
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # the policy version that sampled each token
        self.logits_version = 0  # the version whose forward produced the row's pending next-token logits
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


def _result(row: _Row) -> GenerationResult:
    return GenerationResult(row.tokens, row.logprobs, row.finish, row.stop_string, versions=row.versions)


def _deliver(row: _Row, result: GenerationResult) -> None:
    now = time.perf_counter()
    result.timing.update(queue_s=row.start - row.req.enqueued, batch_s=now - row.start, batch_size=float(row.peak))
    row.req.loop.call_soon_threadsafe(resolve, row.req.future, result)


class HFEngine(BatchingEngine):
    """A transformers CausalLM behind the RolloutEngine interface (batched KV-cache decoding, any device)."""

    def __init__(
        self,
        model,
        tokenizer,
        device: str = "cpu",
        gather_ms: float = 3.0,
        max_batch: int = 64,
        continuous=True,
        bucket_mb: float = 512,
    ):
        self.continuous = continuous  # join requests mid-decode (see module docstring); off: batch to the end
        self.model = model.to(device).eval()
        self._own = self.model.state_dict()  # views of the parameters: what load_weights copies into, by HF name
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
        # model forwards since start (written by the worker thread only; benchmarks read differences):
        # decode steps, rows decoded (= tokens fed), key/value columns attended incl. padding, prefill forwards
        self.counters = {"decode_steps": 0, "decode_rows": 0, "decode_kv_cols": 0, "prefills": 0}
        self._token_text: dict[int, str] = {}  # token id -> its text alone (the stop-string pre-check)
        self._keeps_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        super().__init__(gather_ms=gather_ms, max_batch=max_batch, bucket_mb=bucket_mb)

    # ---- weights (BatchingEngine.load_weights parks them; they land between two decode steps) -------------------
    def check_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        own = self._own
        unknown = [k for k in state_dict if k not in own]
        if unknown:
            raise KeyError(f"load_weights: {len(unknown)} unknown parameter names, e.g. {unknown[:3]}")
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        missing = [k for k in own if k not in state_dict and not (tied and k == "lm_head.weight")]
        if missing:
            raise KeyError(f"load_weights: {len(missing)} parameters missing, e.g. {missing[:3]}")

    def cast_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        own = self._own.get(name)
        if own is None:
            raise KeyError(f"load_weights: unknown parameter name {name!r}")
        return tensor.detach().to(device=own.device, dtype=own.dtype)

    def apply_weights(self, buckets) -> None:
        loaded: set[str] = set()
        for bucket in buckets:
            for name, tensor in bucket:
                self._own[name].copy_(tensor)
                loaded.add(name)
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        missing = [k for k in self._own if k not in loaded and not (tied and k == "lm_head.weight")]
        if missing:  # a stream is only checked once consumed: the version stays, the caller gets the error
            raise KeyError(f"load_weights: {len(missing)} parameters missing, e.g. {missing[:3]}")

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
            room = self.max_batch - live if live == 0 or joinable(batch.past.layers) else 0
            new, stop = self._take(block=live == 0, room=room) if not stopping else ([], False)
            stopping = stopping or stop
            try:
                with self._lock, torch.no_grad():
                    self._apply_pending()  # weights that arrived during the last step land here
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
                    req.loop.call_soon_threadsafe(resolve, req.future, None, exc)
                batch = None

    def _prefill(self, requests: list[Request]) -> _Batch:
        rows = [_Row(r) for r in requests]
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attn[i, width - len(r.prompt_ids) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        # only the last position's logits: a prefill of T tokens would otherwise build T x vocabulary logits (151k
        # columns for Qwen: 0.6 GB and most of the prefill's time at T = 1000)
        last = {"logits_to_keep": 1} if self._keeps_logits else {}
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **last)
        self.counters["prefills"] += 1
        past = out.past_key_values
        grown = [growing(layer, width) for layer in past.layers]
        if joinable(grown):  # else (sliding window...): every layer as the model made it
            past.layers = grown
        batch = _Batch(rows, past, attn, pos[:, -1], out.logits[:, -1, :])
        batch.started = list(rows)
        for row in rows:
            row.peak, row.logits_version = len(rows), self.version
        return batch

    def _join(self, batch: _Batch | None, new: _Batch) -> _Batch:
        """Append `new` rows to the running batch: one cache buffer, both parts right-aligned to one width (attention
        mask 0 on the left padding); one copy per join, none per decode step."""
        if batch is None or not batch.rows:
            return new
        if not joinable(batch.past.layers):
            raise RuntimeError("continuous batching needs full- or linear-attention cache layers (no sliding window)")
        width = max(batch.attn.shape[1], new.attn.shape[1])
        for i, (old, add) in enumerate(zip(batch.past.layers, new.past.layers, strict=True)):
            batch.past.layers[i] = merged([old, add], width)
        batch.attn = torch.cat([left_pad(batch.attn, width, 1), left_pad(new.attn, width, 1)])
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
                if hasattr(layer, "drop_left"):  # GrowingLayer, RecurrentLayer (kv_cache.py)
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
        for row in batch.rows:  # an update landing before the next step does not change what these logits sample
            row.logits_version = self.version

    def _choose(self, rows: list[_Row], logits: torch.Tensor) -> list[int]:
        """Next token of every row (greedy or sampled with the row's generator), recorded on the row. The
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
        tokens = [self._next_token(row, logp[i], greedy[i]) for i, row in enumerate(rows)]
        chosen = logp[torch.arange(len(rows), device=logp.device), torch.tensor(tokens, device=logp.device)]
        for row, token, lp in zip(rows, tokens, chosen.tolist(), strict=True):
            self._record(row, token, lp)
        return tokens

    def _next_token(self, row: _Row, logp: torch.Tensor, greedy: int) -> int:
        """The row's next token: greedy at temperature 0, else sampled from `logp` [V] with the row's generator."""
        if row.req.sampling.temperature == 0:
            return greedy
        return int(torch.multinomial(logp.exp().cpu(), 1, generator=row.generator))

    def _record(self, row: _Row, token: int, logprob: float) -> None:
        """Append the row's token and decide whether the row is finished."""
        row.tokens.append(token)
        row.logprobs.append(logprob)
        row.versions.append(row.logits_version)
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
