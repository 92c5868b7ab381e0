"""The request queue every batching rollout engine shares, and how weight updates reach a running engine.

Concurrent `generate` calls (from many trajectories, on any event loop) go into a thread-safe queue; one background
thread per engine takes them in batches (`_take` / `_gather`) and resolves each caller's future on its own loop.
Subclasses (rsearch_verl/rollout/engines/hf.py, vllm.py) implement `run_batch` and may replace `_worker` with a
continuous loop that joins new requests between decode steps.

Weight updates (`load_weights(state_dict, version)`) never wait for a batch to drain: the new weights are parked
as *pending* and applied under the step lock between two engine steps -- by the decode thread before its next step,
or at once by the caller when the engine is idle. The caller returns once they are in use; generation stalls only
for the copy. `version` (the actor's step) tags every token sampled afterwards, so a trajectory that spans an update
records which policy sampled which token (a partial rollout).

A streamed update (`load_weights(iterable_of_name_tensor_pairs, version)`, the colocated sync: each pair may be an
FSDP collective) is always consumed on the caller's thread: the decode thread, seeing it pending before its next
step, hands over and waits (holding the step lock) until the caller has loaded every bucket, so no decode step ever
sees half-old, half-new weights. Both kinds reach the engine through `apply_weights(buckets)`: pairs cast by
`cast_weight` and grouped by `base.iter_buckets` into lists of at most `bucket_mb` MiB
(rollout.update_weights_bucket_mb).

Sleep state (base.py): `sleep(level)` / `wake_up(tags)` run under the step lock and call the `_sleep` / `_wake_up`
hooks; `generate` refuses while anything is asleep or the weights were discarded.

    class MyEngine(BatchingEngine):
        def run_batch(self, requests): ...                    # one GenerationResult per request
        def apply_weights(self, buckets): ...                 # load each bucket (called under the step lock)
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from rsearch_verl.rollout.engines.base import (
    SLEEP_TAGS,
    GenerationResult,
    RolloutEngine,
    SamplingParams,
    Weights,
    iter_buckets,
)

logger = logging.getLogger(__name__)

_STOP = object()  # queue sentinel: the worker thread exits
_POLL_S = 0.002  # how often a waiting load_weights retries the step lock


@dataclass
class Request:
    """One pending `generate` call; resolved on the caller's event loop."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class _Pending:
    """A parked state-dict update; `error` tells its caller when the decode thread failed to apply it."""

    weights: Mapping[str, torch.Tensor]
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


@dataclass
class _Handoff:
    """A streamed update waiting for the step lock: the decode thread sets `paused` and waits for `resumed`."""

    paused: threading.Event = field(default_factory=threading.Event)
    resumed: threading.Event = field(default_factory=threading.Event)


def resolve(fut: asyncio.Future, result=None, exc: BaseException | None = None) -> None:
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

    def __init__(self, gather_ms: float = 3.0, max_batch: int = 64, bucket_mb: float = 512):
        self.gather_s = gather_ms / 1000.0
        self.max_batch = max_batch
        self.bucket_bytes = int(bucket_mb * (1 << 20))  # one bucket of a weight update (verl's default: 512 MiB)
        self.version = 0
        self.weights_lost = False
        self._asleep: set[str] = set()  # SLEEP_TAGS currently given back (sleep / wake_up)
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.RLock()  # held for one engine step (or one whole batch): weights change between
        self._pending_lock = threading.Lock()
        self._pending: _Pending | None = None
        self._stream: _Handoff | None = None  # a streamed update waiting for the step lock
        self._stream_lock = threading.Lock()  # one streamed update at a time
        self._active = 0  # generate calls awaiting their result (sleep refuses while any is)
        self._active_lock = threading.Lock()
        self._thread = threading.Thread(target=self._worker, name=f"{type(self).__name__}-batcher", daemon=True)
        self._closed = False
        self._thread.start()

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, stop: list[str]) -> GenerationResult:
        check_request(prompt_ids, sampling)
        if self._closed:
            raise RuntimeError("engine is closed")
        if self._asleep or self.weights_lost:
            raise RuntimeError(
                f"generate(): engine asleep ({sorted(self._asleep)}) or its weights discarded by sleep(level=2) "
                f"(weights_lost={self.weights_lost}): wake_up() and load_weights() first"
            )
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._active_lock:
            self._active += 1
        try:
            self._queue.put(Request(list(map(int, prompt_ids)), sampling, list(stop), loop, fut))
            return await fut
        finally:
            with self._active_lock:
                self._active -= 1

    def run_batch(self, requests: list[Request]) -> list[GenerationResult]:
        raise NotImplementedError

    # ---- sleep ------------------------------------------------------------------------------------------------
    def sleep(self, level: int = 2) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep(level={level}): 1 (offload weights) or 2 (discard them)")
        with self._lock:  # between two steps; nothing may be decoding
            if self._active:
                raise RuntimeError(f"sleep(): {self._active} generate calls are still in flight")
            if self._asleep != set(SLEEP_TAGS):
                self._sleep(level)
            self._asleep = set(SLEEP_TAGS)
            self.weights_lost = self.weights_lost or level == 2

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"wake_up(): unknown tags {unknown}; known: {list(SLEEP_TAGS)}")
        with self._lock:
            todo = [t for t in tags if t in self._asleep]
            if todo:
                self._wake_up(todo)
                self._asleep.difference_update(todo)

    @property
    def asleep(self) -> list[str]:
        """The SLEEP_TAGS given back and not yet woken."""
        return [t for t in SLEEP_TAGS if t in self._asleep]

    def _sleep(self, level: int) -> None:
        """Free the engine's accelerator memory (called under the step lock); no-op without a sleep mode."""

    def _wake_up(self, tags: list[str]) -> None:
        """Re-allocate what `_sleep` freed, for `tags` (called under the step lock)."""

    # ---- weights ----------------------------------------------------------------------------------------------
    def check_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Raise a clear error before anything is parked (names, shapes); subclasses know their model."""

    def cast_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """One incoming tensor in the engine's dtype and device (before bucketing: a bucket holds what is loaded)."""
        return tensor.detach()

    def apply_weights(self, buckets: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
        """Load every bucket of (name, tensor) pairs (called under the step lock, no decode step in between)."""
        raise NotImplementedError

    def load_weights(self, weights: Weights, version: int | None = None) -> None:
        if not isinstance(weights, Mapping):
            self._load_stream(weights, version)
            return
        self.check_weights(weights)
        pending = _Pending(weights, self.version + 1 if version is None else int(version))
        with self._pending_lock:
            if self._pending is not None:  # superseded before it landed: its caller returns, the newer one applies
                self._pending.done.set()
            self._pending = pending
        while not pending.done.wait(_POLL_S):
            if self._lock.acquire(blocking=False):  # idle, or between two steps: apply it ourselves
                try:
                    self._apply_pending()
                finally:
                    self._lock.release()
        if pending.error is not None:  # the decode thread failed to apply it
            raise pending.error

    def _load_stream(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None) -> None:
        """Consume a streamed update on this thread, holding off decode steps (module docstring)."""
        with self._stream_lock:
            handoff = _Handoff()
            with self._pending_lock:
                self._stream = handoff
            try:
                while True:
                    if self._lock.acquire(blocking=False):  # idle, or between two steps
                        try:
                            self._swap_in(weights, version)
                        finally:
                            self._end_stream()
                            self._lock.release()
                        return
                    if handoff.paused.wait(_POLL_S):  # the decode thread waits, holding the step lock, until resumed
                        try:
                            self._swap_in(weights, version)
                        finally:
                            self._end_stream()
                            handoff.resumed.set()
                        return
            finally:
                self._end_stream()

    def _end_stream(self) -> None:
        with self._pending_lock:
            self._stream = None

    def _swap_in(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None) -> None:
        """Load `weights` bucket by bucket; only a complete load changes the version."""
        with torch.no_grad():
            cast = ((name, self.cast_weight(name, t)) for name, t in weights)
            self.apply_weights(iter_buckets(cast, self.bucket_bytes))
        self.version = self.version + 1 if version is None else int(version)
        self.weights_lost = False

    def _apply_pending(self) -> None:
        """Apply parked weights, if any, or hand the step lock to a waiting stream (call with the step lock held)."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
            stream = self._stream
        if pending is not None:
            try:
                self._swap_in(pending.weights.items(), pending.version)
            except BaseException as exc:
                pending.error = exc
                raise
            finally:
                pending.done.set()
        if stream is not None and threading.current_thread() is self._thread:
            stream.paused.set()
            stream.resumed.wait()

    # ---- the queue --------------------------------------------------------------------------------------------
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
        """Static batching: gather concurrent requests, run them to the end, resolve every caller."""
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch, stop = self._gather(first)
            start = time.perf_counter()
            try:
                with self._lock:
                    self._apply_pending()
                    results = self.run_batch(batch)
            except Exception as exc:  # noqa: BLE001 - every caller must hear about the failure
                logger.exception("rollout engine batch of %d failed", len(batch))
                for req in batch:
                    req.loop.call_soon_threadsafe(resolve, req.future, None, exc)
            else:
                for req, res in zip(batch, results, strict=True):
                    res.timing.update(queue_s=start - req.enqueued, batch_s=time.perf_counter() - start)
                    res.timing["batch_size"] = float(len(batch))
                    if not res.versions:
                        res.versions = [self.version] * len(res.token_ids)
                    req.loop.call_soon_threadsafe(resolve, req.future, res)
            if stop:
                return
