"""The driver's supervision of the retrieval server: notice an outage, restart the server the run started, and
measure how long search was down.

`check()` runs before every step (and after a rollout that saw search failures): a dead or unresponsive own server is
restarted with backoff (`retriever.supervisor`); an external `retriever.url` is waited for, at most
`retriever.breaker.deadline_s`. While a step runs, `watching()` polls in a background thread (the process, and
`GET /health` every `check_interval_s`), so a server killed mid-rollout is restarted while the rollout's circuit breaker
holds its searches (rsearch_verl/search/breaker.py). A server that cannot be brought back raises `RetrieverDownError`.

    sup = RetrieverSupervisor(service, cfg.retriever)
    sup.check()                         # before a step
    with sup.watching():
        ... run the step ...
    sup.step_metrics()                  # {"retriever/restarts": n, "retriever/down_s": s} since the last call
    sup.take_outages()                  # [{"down_s", "restarts", "recovered"}] that ended, for summary.json
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import httpx

from rsearch_verl import signals as sig
from rsearch_verl.config import RetrieverConfig
from rsearch_verl.search.breaker import RetrieverDownError
from rsearch_verl.search.service import RetrieverError, RetrieverService

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0


class RetrieverSupervisor:
    def __init__(self, service: RetrieverService, cfg: RetrieverConfig):
        self.service, self.cfg, self.sup = service, cfg, cfg.supervisor
        self.outages: list[dict] = []  # one per outage: {"down_s", "restarts", "recovered"}
        self._lock = threading.RLock()  # the watch thread and the step loop may both act
        self._down_since: float | None = None  # monotonic start of the current outage
        self._failed_probes = 0
        self._restarts_this_outage = 0
        self._step = {"restarts": 0, "down_s": 0.0}  # since the last step_metrics()
        self._accounted_until: float | None = None  # down time before this instant is already in _step

    # ---- the step loop's API ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Return once the retriever answers; restart the own server or wait for an external one as needed."""
        deadline = time.monotonic() + self.cfg.breaker.deadline_s
        while not self._probe_once():
            if time.monotonic() >= deadline:
                raise RetrieverDownError(self._down_message())
            time.sleep(min(self.sup.check_interval_s, max(0.0, deadline - time.monotonic())))

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Poll the server in a background thread while the body (a training step) runs."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self.sup.check_interval_s):
                try:
                    self._probe_once()
                except RetrieverDownError as exc:  # the next check() or the rollout's breaker deadline stops the run
                    logger.error("%s", exc)
                    return
                except Exception:  # noqa: BLE001 - the watcher must never die silently mid-run
                    logger.exception("retriever supervision failed")

        thread = threading.Thread(target=loop, name="retriever-supervisor", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=self.sup.health_timeout_s + 5)

    def step_metrics(self) -> dict[str, float]:
        """`retriever/restarts` and `retriever/down_s` since the previous call (one row of metrics.jsonl)."""
        with self._lock:
            now = time.monotonic()
            if self._down_since is not None:  # an outage still open: count its time so far in this step
                self._step["down_s"] += now - max(self._down_since, self._accounted_until or self._down_since)
                self._accounted_until = now
            out = {sig.RETRIEVER_RESTARTS: float(self._step["restarts"]), sig.RETRIEVER_DOWN_S: self._step["down_s"]}
            self._step = {"restarts": 0, "down_s": 0.0}
            return out

    def take_outages(self) -> list[dict]:
        """The outages that ended since the last call: [{"down_s", "restarts", "recovered"}]."""
        with self._lock:
            out, self.outages = self.outages, []
            return out

    # ---- internals --------------------------------------------------------------------------------------------
    def _probe_once(self) -> bool:
        """One look at the server; restart the own server when it is down. True when it answers."""
        with self._lock:
            if self.service.alive() and self._healthy():
                self._failed_probes = 0
                if self._down_since is not None:
                    self._recovered()
                return True
            self._failed_probes += 1
            dead = not self.service.alive()
            if not dead and self._failed_probes < self.sup.unhealthy_after:
                return False  # one slow probe is not an outage yet
            if self._down_since is None:
                self._down_since = time.monotonic()
                self._restarts_this_outage = 0
                logger.warning("retrieval server %s is down (%s)", self.service.url, "exited" if dead else "no answer")
            if self.service.owned:
                return self._restart_with_backoff()
            return False

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.service.url}/health", timeout=self.sup.health_timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def _restart_with_backoff(self) -> bool:
        if self._restarts_this_outage >= self.sup.max_restarts:
            raise RetrieverDownError(self._down_message())
        delay = min(MAX_BACKOFF_S, self.sup.backoff_s * 2**self._restarts_this_outage)
        self._restarts_this_outage += 1
        self._step["restarts"] += 1
        time.sleep(delay)
        try:
            self.service.restart()
        except RetrieverError as exc:
            logger.warning("restart %d of the retrieval server failed: %s", self._restarts_this_outage, exc)
            return False
        self._recovered()
        return True

    def _recovered(self) -> None:
        now = time.monotonic()
        down_s = now - self._down_since
        self._step["down_s"] += now - max(self._down_since, self._accounted_until or self._down_since)
        self.outages.append({"down_s": round(down_s, 3), "restarts": self._restarts_this_outage, "recovered": True})
        logger.warning(
            "retrieval server %s is back after %.1f s (%d restart(s))", self.service.url, down_s,
            self._restarts_this_outage,
        )  # fmt: skip
        self._down_since, self._accounted_until, self._failed_probes = None, None, 0

    def open_outage(self) -> dict | None:
        """The outage in progress, if any (for the summary of a run that stops because of it)."""
        with self._lock:
            if self._down_since is None:
                return None
            return {"down_s": round(time.monotonic() - self._down_since, 3), "restarts": self._restarts_this_outage,
                    "recovered": False}  # fmt: skip

    def _down_message(self) -> str:
        if self.service.owned:
            return (
                f"the retrieval server this run started ({self.service.url}) is down and {self._restarts_this_outage} "
                f"restart(s) failed (retriever.supervisor.max_restarts={self.sup.max_restarts}); its log is "
                "retriever.log in the run directory"
            )
        return (
            f"the retriever at retriever.url={self.service.url} did not answer GET /health for "
            f"{self.cfg.breaker.deadline_s:g} s (retriever.breaker.deadline_s)"
        )
