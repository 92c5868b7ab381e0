"""Search circuit breaker: a rollout pauses while the retriever is down instead of feeding the policy error
observations.

A `SearchFn` wrapper, one per rollout process (like its `SearchClient`), configured by `retriever.breaker`. It keeps
the outcome of the last `window` search calls (after the client's own retries). A failure counts when it is an outage
(`SearchError.outage`: timeout, connection, HTTP 5xx / 429), not a request the server rejected. When at least
`failure_rate` of the window failed (and `min_calls` outcomes are in it) the breaker opens:

- the failing call and every later one wait, probing the retriever (`GET /health` for our server) every
  `probe_interval_s`; when the probe answers they try again, and the first success closes the breaker;
- an outage that lasts `deadline_s` raises `RetrieverDownError` (not a `SearchError`, so no protocol turns it into an
  observation): the rollout fails and the driver checkpoints and stops (rsearch_verl/trainer/loop.py).

Failures before the breaker opens still become error observations; the agent loop marks those trajectories
(`search_failed`) and the trainer drops them from the update. Usage:

    breaker = CircuitBreaker(client, cfg.retriever.breaker, probe=client.healthy, where=cfg.retriever.url)
    docs = await breaker(["query"], 3, "local")
    pages = await breaker.documents(["doc7"], 0, "local")   # whole-document pages (the open tool), held the same way
    breaker.metrics(reset=True)     # {"search/breaker_trips": ..., "search/breaker_wait_s": ...}
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rsearch_verl import signals as sig
from rsearch_verl.config import BreakerConfig
from rsearch_verl.search.client import SearchError
from rsearch_verl.search.types import Doc, DocumentPage, SearchFn

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RetrieverDownError(RuntimeError):
    """The retriever stayed unreachable past `retriever.breaker.deadline_s`; the run must checkpoint and stop."""


class CircuitBreaker:
    def __init__(
        self,
        search: SearchFn,
        cfg: BreakerConfig,
        probe: Callable[[str], Awaitable[bool]] | None = None,
        where: str | None = None,
    ):
        self.search, self.cfg, self.probe = search, cfg, probe
        self.where = where or "the retriever"
        self._outcomes: deque[bool] = deque(maxlen=cfg.window)  # True = an outage failure
        self.opened_at: float | None = None  # monotonic time the breaker opened; None = closed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gate: asyncio.Lock | None = None  # one prober at a time; the other waiters queue behind it
        self._probe_at, self._probe_ok = float("-inf"), False  # the last probe: when, and whether it answered
        self._counts = {"trips": 0, "wait_s": 0.0}

    async def __call__(self, queries: list[str], topk: int, source: str = "local") -> list[list[Doc]]:
        return await self._guarded(lambda: self.search(queries, topk, source), source)

    async def documents(self, ids: list[str], page: int = 0, source: str = "local") -> list[DocumentPage]:
        """The wrapped client's `documents` (the `open` tool's pages), held during an outage like a search."""
        fn = getattr(self.search, "documents", None)
        if fn is None:
            raise SearchError("config", "this search backend serves no documents")
        return await self._guarded(lambda: fn(ids, page, source), source)

    async def _guarded(self, call: Callable[[], Awaitable[T]], source: str) -> T:
        while True:
            if self.opened_at is not None:
                await self._wait_for_retriever(source)
            try:
                docs = await call()
            except SearchError as err:
                if not err.outage:
                    raise
                self._outcomes.append(True)
                self._probe_ok = False  # a search failed after the last probe: probe again before retrying
                if self.opened_at is None and not self._should_trip():
                    raise  # below the threshold: an error observation (the trajectory is marked and dropped)
                self._trip(err)
                continue  # wait for the retriever, then try this search again
            self._outcomes.append(False)
            if self.opened_at is not None:
                logger.warning("search circuit closed: %s answers again after %.1f s", self.where, self._open_s())
                self.opened_at = None
                self._outcomes.clear()
            return docs

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """Trips and seconds searches spent paused since the last reset (per rollout batch)."""
        out = {sig.BREAKER_TRIPS: float(self._counts["trips"]), sig.BREAKER_WAIT_S: self._counts["wait_s"]}
        if reset:
            self._counts = {"trips": 0, "wait_s": 0.0}
        return out

    # ---- internals --------------------------------------------------------------------------------------------
    def _should_trip(self) -> bool:
        failed = sum(self._outcomes)
        return len(self._outcomes) >= self.cfg.min_calls and failed >= self.cfg.failure_rate * len(self._outcomes)

    def _trip(self, err: SearchError) -> None:
        if self.opened_at is not None:
            return
        self.opened_at = time.monotonic()
        self._counts["trips"] += 1
        failed = sum(self._outcomes)
        logger.warning(
            "search circuit open: %d of the last %d searches failed (%s); rollout paused until %s answers "
            "(at most %.0f s, retriever.breaker.deadline_s)",
            failed,
            len(self._outcomes),
            err.kind,
            self.where,
            self.cfg.deadline_s,
        )

    def _open_s(self) -> float:
        return 0.0 if self.opened_at is None else time.monotonic() - self.opened_at

    def _lock(self) -> asyncio.Lock:
        # asyncio primitives belong to one event loop; each rollout batch may run on a fresh one
        loop = asyncio.get_running_loop()
        if loop is not self._loop or self._gate is None:
            self._loop, self._gate = loop, asyncio.Lock()
        return self._gate

    async def _wait_for_retriever(self, source: str) -> None:
        """Return when a fresh probe says the retriever answers; raise RetrieverDownError past the deadline."""
        start = time.monotonic()
        try:
            async with self._lock():
                while self.opened_at is not None:
                    if self._open_s() >= self.cfg.deadline_s:
                        raise RetrieverDownError(
                            f"{self.where} did not answer for {self._open_s():.0f} s "
                            f"(retriever.breaker.deadline_s={self.cfg.deadline_s:g})"
                        )
                    since = time.monotonic() - self._probe_at
                    if since < self.cfg.probe_interval_s:
                        if self._probe_ok:
                            return  # another waiter's probe just said yes
                        remaining = self.cfg.deadline_s - self._open_s()
                        await asyncio.sleep(max(0.0, min(self.cfg.probe_interval_s - since, remaining)))
                        continue
                    self._probe_ok = self.probe is None or await self.probe(source)
                    self._probe_at = time.monotonic()
        finally:
            self._counts["wait_s"] += time.monotonic() - start
