"""Run control: what the driver decides between training steps, apart from the step itself (docs/health.md).

The control decides; the loop (`trainer/loop.Trainer`) acts. It holds no reference to the run: each call returns a
decision, a small frozen record the loop carries out, and the control's own bookkeeping (the run's health, the last
applied step) is already up to date when the decision comes back, so a checkpoint the loop writes for it holds it.

After every step the watchdog judges its metrics: a healthy step's update counts (`done_step`, decision `Continue`);
a tripped one is rolled back to the last complete checkpoint at a lower lr (`RollbackTo`), and its row is never logged
(its trips and retriever outage counts go to the next row). What the run cannot continue from safely (rollbacks used
up or nothing to roll back to; an error: the retriever gone past its deadline, a rejected credential, a record /
replay store of another index, a dead Ray worker) is a `Stop` whose message says what to do; an outage checkpoints
the last applied update first.

    control = RunControl(ckpts, health, cfg.trainer.watchdog, supervisor)
    with control.supervised(step):                # the retriever checked before, watched during
        metrics = trainer.train_step(step)
    match control.judge(step, metrics):
        case Continue(row):                       # validate, log the row, save when due: the update counts
        case RollbackTo(path, step, lr_scale):    # restore `path`, then set the lr scale; redo the steps after it
        case Stop(message, save_step):            # save `save_step` (when not None), then raise RunStopped(message)
    stop = control.stopped(exc)                   # the Stop an error amounts to, or None (a crash)
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from rsearch_verl import signals as sig
from rsearch_verl.config import WatchdogConfig
from rsearch_verl.search.breaker import RetrieverDownError
from rsearch_verl.search.client import SearchAuthError
from rsearch_verl.search.store import StoreMismatchError
from rsearch_verl.search.supervisor import RetrieverSupervisor
from rsearch_verl.trainer.checkpoint import CheckpointManager, step_dir_name
from rsearch_verl.trainer.health import RunStopped
from rsearch_verl.trainer.health.report import RunHealth
from rsearch_verl.trainer.health.watchdog import Watchdog

logger = logging.getLogger(__name__)

RESUME = "rerun with the same trainer.run_dir (trainer.resume=auto)"


@dataclass(frozen=True)
class Continue:
    """The step's update counts (it is the control's `done_step` now): the loop logs `row` (the step's metrics and the
    run's health metrics; validation adds to it) and saves when due."""

    row: Mapping[str, float]


@dataclass(frozen=True)
class RollbackTo:
    """The watchdog tripped: the loop restores the complete checkpoint at `path` (that of `step`), then sets the
    learning rates to `lr_scale` x the configured ones (after the restore: it loads the optimizer's own lr), and redoes
    the steps after `step`. The tripped step's row is never logged."""

    path: str
    step: int
    lr_scale: float


@dataclass(frozen=True)
class Stop:
    """The run cannot go on: the loop saves the checkpoint of `save_step` (None: nothing to save) and raises
    `RunStopped(message)`. The stop is in the run's health already, so the checkpoint records it."""

    message: str
    save_step: int | None = None


class RunControl:
    def __init__(
        self,
        ckpts: CheckpointManager,
        health: RunHealth,
        watchdog: WatchdogConfig,
        supervisor: RetrieverSupervisor | None = None,
    ):
        self.ckpts, self.health, self.supervisor = ckpts, health, supervisor
        self.cfg, self.watchdog = watchdog, Watchdog(watchdog)
        self.done_step = 0  # the last step whose update is applied
        self._marks: dict[str, float] = {}  # the last rollback's trip metrics, logged with the next row

    @contextlib.contextmanager
    def supervised(self, step: int) -> Iterator[None]:
        """Check the retriever before the body and watch it during; its outage metrics go to the step's row."""
        if self.supervisor is None:
            yield
            return
        try:
            self.supervisor.check()
            with self.supervisor.watching():
                yield
        finally:
            self.health.add_outages(self.supervisor.take_outages(), step)

    def judge(self, step: int, metrics: Mapping[str, float]) -> Continue | RollbackTo | Stop:
        """Add the run's health metrics to the step's and let the watchdog judge them: `Continue` when the update
        counts (it is now `done_step`), `RollbackTo` the last complete checkpoint, or `Stop` when there is none or the
        rollbacks are used up."""
        row = {**metrics, **self._health_metrics()}
        self.health.add_step(row)
        trips = self.watchdog.check(step, row)
        if trips:
            return self._rollback(step, trips, row)
        self.done_step = step
        return Continue(row)

    def _health_metrics(self) -> dict[str, float]:
        out = self.supervisor.step_metrics() if self.supervisor is not None else {}
        out[sig.ROLLBACKS] = float(len(self.health.rollbacks))
        for key, value in self._marks.items():  # counts of a rolled-back step add to this one's
            out[key] = out.get(key, 0.0) + value
        self._marks = {}
        return out

    def _rollback(self, step: int, trips: dict[str, float], row: dict[str, float]) -> RollbackTo | Stop:
        """The watchdog tripped at `step`: roll back to the last complete checkpoint at a lower lr."""
        what = ", ".join(f"{k}={v:.4g}" for k, v in trips.items())
        complete = self.ckpts.complete_checkpoints()
        if not complete or len(self.health.rollbacks) >= self.cfg.max_rollbacks:
            why = (
                "there is no complete checkpoint to roll back to (lower trainer.save_freq)"
                if not complete
                else f"all {self.cfg.max_rollbacks} rollbacks are used (trainer.watchdog.max_rollbacks)"
            )
            return self._stop(
                f"health watchdog tripped at step {step} ({what}) and {why}", f"Fix the cause, then {RESUME}."
            )
        restored, path = complete[-1]
        self.done_step = restored
        scale = self.health.lr_scale * self.cfg.lr_factor
        self.health.record_rollback(step, restored, trips, scale)
        self.watchdog.forget_after(restored)
        self._marks = {**{sig.trip(k): 1.0 for k in trips}, sig.ROLLED_BACK_FROM: float(step)}
        self._marks.update({k: row[k] for k in sig.CARRIED_OVER_ROLLBACK if k in row})
        logger.warning("health watchdog tripped at step %d (%s): rolling back to step %d, lr x%g", step, what,
                       restored, scale)  # fmt: skip
        return RollbackTo(path, restored, scale)

    def stopped(self, exc: BaseException) -> Stop | None:
        """The Stop that `exc` amounts to (with the last applied update to save where that is safe), or None for other
        errors (a crash: the loop raises it as it is)."""
        # heavy: ray (seconds to import) only when a cluster is used
        import ray

        step = self.done_step + 1
        cause = getattr(exc, "cause", None) or exc  # a RayTaskError carries the worker's exception as its cause
        if isinstance(exc, RunStopped):
            return self._stop(str(exc), f"Fix the cause, then {RESUME}.")
        if isinstance(cause, RetrieverDownError):
            reason = str(cause).splitlines()[0]
            if self.supervisor is not None and (outage := self.supervisor.open_outage()) is not None:
                self.health.add_outages([outage], step)
            if self.done_step == 0:
                return self._stop(
                    reason, f"Nothing was trained yet, so there is no checkpoint to save. {self._retry()}"
                )
            # the interrupted step's batch and those generated ahead stay unused: save() stores the loader before them
            saved = os.path.join(self.ckpts.root, step_dir_name(self.done_step))
            advice = f"Saved the checkpoint of step {self.done_step} ({saved}). {self._retry()}"
            return self._stop(reason, advice, save_step=self.done_step)
        if isinstance(cause, SearchAuthError):  # a rejected credential: every search would fail the same way
            advice = "Fix the credential, then rerun with the same trainer.run_dir."
            return self._stop(str(cause).splitlines()[0], advice)
        if isinstance(cause, StoreMismatchError):  # a store of another index: every live search would mix the two
            advice = "Point retriever.url at the index the store was recorded from, or record a new store, then rerun."
            return self._stop(str(cause).splitlines()[0], advice)
        if isinstance(exc, ray.exceptions.RayActorError | ray.exceptions.WorkerCrashedError):
            reason = f"a Ray worker died ({type(exc).__name__}: {str(exc).splitlines()[0][:300]})"
            latest = self.ckpts.latest()
            advice = (
                f"The last complete checkpoint is {latest}; {RESUME} to continue from it."
                if latest
                else "No checkpoint was written yet; rerun to start over."
            )
            return self._stop(reason, advice)
        return None

    def _stop(self, reason: str, advice: str, save_step: int | None = None) -> Stop:
        """Record the stop in the run's health (the first one: what stopped the run) and decide it."""
        step = self.done_step + 1
        if self.health.stop is None:
            self.health.record_stop(step, reason)
        return Stop(f"run stopped during step {step}: {reason}. {advice}", save_step)

    def _retry(self) -> str:
        return f"{self._retriever_advice()}, then {RESUME} to continue."

    def _retriever_advice(self) -> str:
        service = self.supervisor.service if self.supervisor is not None else None
        if service is None:
            return "Bring the retriever back"
        if service.owned:
            return f"The retrieval server this run started ({service.url}) did not come back: see retriever.log"
        return f"Bring the retriever at retriever.url={service.url} back (or point retriever.url at another one)"
