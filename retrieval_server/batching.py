"""Adaptive dynamic micro-batching: concurrent requests coalesce into one call of a batch function.

Every request's job goes into one queue owned by the event loop. `workers` executor threads (1 by default) run the
batch function (encode + index search + serialisation), so the event loop keeps accepting and parsing requests while
the encoder runs (torch and FAISS release the GIL). Dispatch is adaptive:

* a search thread is idle -> the queue is dispatched at once (optionally after `batch_wait_ms` to let a burst
  gather), so a lone client pays no batching delay;
* every search thread is busy -> jobs simply collect; when a running batch finishes, everything that arrived
  meanwhile (up to `batch_max` queries) goes out as the next batch. Under load the batch size therefore tracks
  the arrival rate times the batch latency, with no fixed window to tune.

The wait is bounded by one batch's run time (plus `batch_wait_ms`), the batch by `batch_max` queries (a single
job larger than that runs alone, searched in chunks of `batch_max`). Results are split back per job in order.

With `workers=2` on a 2-core CPU, two batches can run at once, each on one core (the server's `on_start` hook sets
the torch threads of the batch's thread: all cores for a lone batch, a share for concurrent ones); why that pays
is measured in docs/retriever.md ("Batching and threads").

Usage:
    batcher = MicroBatcher(run_batch, batch_max=64, workers=1)   # run_batch(list[item]) -> list[result]
    result = await batcher.submit(item, n_queries=len(item_queries))
    batcher.close()
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class BatchStats:
    """Counters shown by GET /health: how much coalescing actually happened."""

    batches: int = 0
    jobs: int = 0
    queries: int = 0
    max_batch_queries: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, float]:
        mean = self.queries / self.batches if self.batches else 0.0
        return {**self.__dict__, "mean_batch_queries": round(mean, 2)}


@dataclass
class _Job:
    item: Any
    n_queries: int
    future: asyncio.Future = field(repr=False)


class MicroBatcher:
    """Coalesce concurrent `submit` calls into `run_batch(items)` calls on up to `workers` threads.

    `on_start(n)`, when given, runs on the worker thread just before each batch, with n = the number of batches
    running at that moment (this one included): the server uses it to give a lone batch every core and split
    the cores between concurrent ones.
    """

    def __init__(
        self,
        run_batch: Callable[[list[Any]], Sequence[Any]],
        batch_max: int = 64,
        batch_wait_ms: float = 0.0,
        workers: int = 1,
        on_start: Callable[[int], None] | None = None,
    ):
        if batch_max < 1:
            raise ValueError(f"batch_max must be >= 1, got {batch_max}")
        if batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {batch_wait_ms}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._run_batch = run_batch
        self._on_start = on_start
        self._batch_max = batch_max
        self._wait_s = batch_wait_ms / 1000.0
        # At most `workers` batches run at once; `run_batch` must be safe to call from that many threads.
        self._workers = workers
        # While one batch runs, a second starts only with this many queries: a lone query on its own thread costs
        # ~4x the CPU per query of a 16-query forward, so small parallel batches lower throughput; measured at 64
        # clients, batch_max // 8 let p99 latency reach 2.8x p50, batch_max // 4 keeps it ~1.6x.
        self._parallel_min = max(1, batch_max // 4)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="retrieval-search")
        self._pending: deque[_Job] = deque()
        self._pending_queries = 0
        self._running = 0  # batches on the executor now
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self.stats = BatchStats()

    async def submit(self, item: Any, n_queries: int) -> Any:
        """Queue one job (`n_queries` queries) and wait for its slice of the batch result."""
        if self._closed:
            raise RuntimeError("batcher is closed")
        loop = asyncio.get_running_loop()
        job = _Job(item=item, n_queries=n_queries, future=loop.create_future())
        self._pending.append(job)
        self._pending_queries += n_queries
        self._maybe_dispatch(loop)
        return await job.future

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop accepting jobs and let the worker thread go (a running batch finishes in the background)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for job in self._pending:
            if not job.future.done():
                job.future.set_exception(RuntimeError("server shutting down"))
        self._pending.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _maybe_dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._running >= self._workers or not self._pending or self._closed:
            return
        if self._running and self._pending_queries < self._parallel_min:
            return  # a batch is running: start another only with enough queries to be worth a forward
        if self._wait_s > 0 and self._pending_queries < self._batch_max:
            if self._timer is None:  # idle: give a burst `batch_wait_ms` to gather, once
                self._timer = loop.call_later(self._wait_s, self._on_timer, loop)
            return
        self._dispatch(loop)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        if self._running < self._workers and self._pending:
            self._dispatch(loop)

    def _take_batch(self) -> list[_Job]:
        jobs: list[_Job] = []
        n = 0
        while self._pending:
            job = self._pending[0]
            if job.future.done():  # the client went away before dispatch: drop its job, do no work for it
                self._pending.popleft()
                self._pending_queries -= job.n_queries
                continue
            if jobs and n + job.n_queries > self._batch_max:
                break
            self._pending.popleft()
            self._pending_queries -= job.n_queries
            jobs.append(job)
            n += job.n_queries
        return jobs

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        jobs = self._take_batch()
        if not jobs:
            return
        self._running += 1
        n = sum(job.n_queries for job in jobs)
        self.stats.batches += 1
        self.stats.jobs += len(jobs)
        self.stats.queries += n
        self.stats.max_batch_queries = max(self.stats.max_batch_queries, n)
        fut = loop.run_in_executor(self._executor, self._call, [job.item for job in jobs], self._running)
        fut.add_done_callback(lambda f: self._on_batch_done(loop, jobs, f))

    def _call(self, items: list[Any], running: int) -> Sequence[Any]:
        if self._on_start is not None:
            self._on_start(running)
        return self._run_batch(items)

    def _on_batch_done(self, loop: asyncio.AbstractEventLoop, jobs: list[_Job], fut: asyncio.Future) -> None:
        self._running -= 1
        if fut.cancelled():
            exc: BaseException | None = RuntimeError("batch cancelled")
        else:
            exc = fut.exception()
        if exc is None:
            results = fut.result()
            if len(results) != len(jobs):
                exc = RuntimeError(f"run_batch returned {len(results)} results for {len(jobs)} jobs")
        if exc is not None:
            self.stats.errors += 1
            logger.error("batch of %d jobs failed: %r", len(jobs), exc)
        for i, job in enumerate(jobs):
            if job.future.done():
                continue
            if exc is not None:
                job.future.set_exception(exc)
            else:
                job.future.set_result(results[i])
        # Whatever queued while this batch ran has already waited one batch time: send it out now, no timer
        # (unless another batch still runs and too little is queued: then it waits for more, or for that batch).
        if self._pending and not self._closed and (not self._running or self._pending_queries >= self._parallel_min):
            self._dispatch(loop)
