"""Run control: what the driver decides between training steps, apart from the step itself (docs/health.md).

After every step the watchdog judges its metrics: a healthy step's update counts (`done_step`); a tripped one is rolled
back to the last complete checkpoint at a lower lr, and its row is never logged (its trips and retriever outage counts
go to the next row). An error that the run cannot continue from safely (the retriever gone past its deadline, a
rejected credential, a dead Ray worker, rollbacks used up) becomes a `RunStopped` whose message says what to do; an
outage checkpoints the last applied update first.

The control does not touch workers itself: it asks the run (the `Run` protocol, `trainer/loop.Trainer`) to restore,
save, rescale the lr and log.

    control = RunControl(trainer, ckpts, health, cfg.trainer.watchdog, supervisor)
    with control.supervised(step):                # the retriever checked before, watched during
        metrics = trainer.train_step(step)
    restored = control.judge(step, metrics)       # None: the update counts; else the step it rolled back to
    ...
    control.logged()                              # the step's row is written
    stop = control.stopped(exc)                   # RunStopped (after saving what can be saved) or None
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Protocol

from rsearch_verl import signals as sig
from rsearch_verl.config import WatchdogConfig
from rsearch_verl.search.breaker import RetrieverDownError
from rsearch_verl.search.client import SearchAuthError
from rsearch_verl.search.supervisor import RetrieverSupervisor
from rsearch_verl.trainer.checkpoint import CheckpointManager
from rsearch_verl.trainer.health import RunStopped
from rsearch_verl.trainer.health.report import RunHealth
from rsearch_verl.trainer.health.watchdog import Watchdog

logger = logging.getLogger(__name__)

RESUME = "rerun with the same trainer.run_dir (trainer.resume=auto)"


class Run(Protocol):
    """What the control asks of the run it controls."""

    def restore(self, path: str) -> tuple[int, dict]: ...  # load a complete checkpoint: (its step, trainer state)

    def save(self, step: int) -> None: ...

    def set_lr_scale(self, scale: float) -> None: ...

    def log(self, metrics: dict, step: int) -> None: ...


class RunControl:
    def __init__(
        self,
        run: Run,
        ckpts: CheckpointManager,
        health: RunHealth,
        watchdog: WatchdogConfig,
        supervisor: RetrieverSupervisor | None = None,
    ):
        self.run, self.ckpts, self.health, self.supervisor = run, ckpts, health, supervisor
        self.cfg, self.watchdog = watchdog, Watchdog(watchdog)
        self.done_step = 0  # the last step whose update is applied
        self._unlogged: dict | None = None  # the metrics of the step whose update is applied, until they are logged
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

    def judge(self, step: int, metrics: dict[str, float]) -> int | None:
        """Add the run's health metrics to the step's and let the watchdog judge them: None when the update counts
        (it is now `done_step`), else the step the run rolled back to."""
        metrics.update(self._health_metrics())
        self.health.add_step(metrics)
        trips = self.watchdog.check(step, metrics)
        if trips:
            return self._rollback(step, trips, metrics)
        self.done_step, self._unlogged = step, metrics
        return None

    def logged(self) -> None:
        """The applied step's row is written (a stop no longer needs to log it)."""
        self._unlogged = None

    def _health_metrics(self) -> dict[str, float]:
        out = self.supervisor.step_metrics() if self.supervisor is not None else {}
        out[sig.ROLLBACKS] = float(len(self.health.rollbacks))
        for key, value in self._marks.items():  # counts of a rolled-back step add to this one's
            out[key] = out.get(key, 0.0) + value
        self._marks = {}
        return out

    def _rollback(self, step: int, trips: dict[str, float], metrics: dict[str, float]) -> int:
        """The watchdog tripped at `step`: restore the last complete checkpoint, lower the lr, return its step."""
        what = ", ".join(f"{k}={v:.4g}" for k, v in trips.items())
        path = self.ckpts.latest()
        if path is None or len(self.health.rollbacks) >= self.cfg.max_rollbacks:
            why = (
                "there is no complete checkpoint to roll back to (lower trainer.save_freq)"
                if path is None
                else f"all {self.cfg.max_rollbacks} rollbacks are used (trainer.watchdog.max_rollbacks)"
            )
            raise RunStopped(f"health watchdog tripped at step {step} ({what}) and {why}")
        restored, _ = self.run.restore(path)
        self.done_step, self._unlogged = restored, None
        scale = self.health.lr_scale * self.cfg.lr_factor
        self.run.set_lr_scale(scale)
        self.health.record_rollback(step, restored, trips, scale)
        self.watchdog.forget_after(restored)
        self._marks = {**{sig.trip(k): 1.0 for k in trips}, sig.ROLLED_BACK_FROM: float(step)}
        self._marks.update({k: metrics[k] for k in sig.CARRIED_OVER_ROLLBACK if k in metrics})
        logger.warning("health watchdog tripped at step %d (%s): rolled back to step %d, lr x%g", step, what,
                       restored, scale)  # fmt: skip
        return restored

    def stopped(self, exc: BaseException) -> RunStopped | None:
        """The RunStopped that `exc` amounts to (checkpointing first where that is safe), or None for other errors."""
        import ray

        step = self.done_step + 1
        cause = getattr(exc, "cause", None) or exc  # a RayTaskError carries the worker's exception as its cause
        if isinstance(exc, RunStopped):
            reason, advice = str(exc), f"Fix the cause, then {RESUME}."
        elif isinstance(cause, RetrieverDownError):
            reason = str(cause).splitlines()[0]
            if self.supervisor is not None and (outage := self.supervisor.open_outage()) is not None:
                self.health.add_outages([outage], step)
            advice = f"{self._save_on_stop(step, reason)} {self._retriever_advice()}, then {RESUME} to continue."
        elif isinstance(cause, SearchAuthError):  # a rejected credential: every search would fail the same way
            reason, advice = str(cause).splitlines()[0], "Fix the credential, then rerun with the same trainer.run_dir."
        elif isinstance(exc, ray.exceptions.RayActorError | ray.exceptions.WorkerCrashedError):
            reason = f"a Ray worker died ({type(exc).__name__}: {str(exc).splitlines()[0][:300]})"
            latest = self.ckpts.latest()
            advice = (
                f"The last complete checkpoint is {latest}; {RESUME} to continue from it."
                if latest
                else "No checkpoint was written yet; rerun to start over."
            )
        else:
            return None
        if self.health.stop is None:
            self.health.record_stop(step, reason)
        return RunStopped(f"run stopped during step {step}: {reason}. {advice}")

    def _retriever_advice(self) -> str:
        service = self.supervisor.service if self.supervisor is not None else None
        if service is None:
            return "Bring the retriever back"
        if service.owned:
            return f"The retrieval server this run started ({service.url}) did not come back: see retriever.log"
        return f"Bring the retriever at retriever.url={service.url} back (or point retriever.url at another one)"

    def _save_on_stop(self, step: int, reason: str) -> str:
        """Checkpoint the last applied update (the interrupted step's batch goes back to the loader)."""
        if self._unlogged is not None:
            self.run.log(self._unlogged, self.done_step)  # the update is applied; its validation was cut short
        # the interrupted step's batch and those generated ahead stay unused: save() stores the loader before them
        if self.done_step == 0:
            return "Nothing was trained yet, so there is no checkpoint to save."
        self.health.record_stop(step, reason)
        self.run.save(self.done_step)
        return f"Saved the checkpoint of step {self.done_step} ({self.ckpts.latest()})."
