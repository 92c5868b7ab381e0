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

    class MyEngine(BatchingEngine):
        def run_batch(self, requests): ...                    # one GenerationResult per request
        def apply_weights(self, state_dict): ...              # copy the weights in (called under the step lock)
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

    def __init__(self, gather_ms: float = 3.0, max_batch: int = 64):
        self.gather_s = gather_ms / 1000.0
        self.max_batch = max_batch
        self.version = 0
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.RLock()  # held for one engine step (or one whole batch): weights change between
        self._pending_lock = threading.Lock()
        self._pending: tuple[dict, int, threading.Event] | None = None
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

    # ---- weights ----------------------------------------------------------------------------------------------
    def check_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Raise a clear error before anything is parked (names, shapes); subclasses know their model."""

    def apply_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> None:
        self.check_weights(state_dict)
        done = threading.Event()
        with self._pending_lock:
            if self._pending is not None:  # superseded before it landed: its caller returns, the newer one applies
                self._pending[2].set()
            self._pending = (state_dict, self.version + 1 if version is None else int(version), done)
        while not done.wait(_POLL_S):
            if self._lock.acquire(blocking=False):  # idle, or between two steps: apply it ourselves
                try:
                    self._apply_pending()
                finally:
                    self._lock.release()

    def _apply_pending(self) -> None:
        """Apply parked weights, if any (call with the step lock held)."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        state_dict, version, done = pending
        try:
            with torch.no_grad():
                self.apply_weights(state_dict)
            self.version = version
        finally:
            done.set()

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
