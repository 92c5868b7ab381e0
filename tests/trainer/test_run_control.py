"""Run control between steps (rsearch_verl/trainer/run_control.py) on a fake run and real checkpoints: healthy steps
count, a watchdog trip rolls back (lr lowered, trip metrics on the next row, rollbacks capped), errors become
RunStopped with advice, and an outage saves the last applied update first."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest

from rsearch_verl import signals as sig
from rsearch_verl.config import WatchdogConfig
from rsearch_verl.search.breaker import RetrieverDownError
from rsearch_verl.trainer.checkpoint import CheckpointManager
from rsearch_verl.trainer.health import RunStopped
from rsearch_verl.trainer.health.report import RunHealth
from rsearch_verl.trainer.run_control import RunControl

HEALTHY = {sig.PG_LOSS: 0.1, sig.ACTOR_GRAD_NORM: 1.0}
NAN = {sig.PG_LOSS: math.nan, sig.ACTOR_GRAD_NORM: math.nan}


class FakeRun:
    """The run the control acts on: checkpoints are real directories, the rest is recorded."""

    def __init__(self, ckpts: CheckpointManager):
        self.ckpts, self.calls, self.rows = ckpts, [], []

    def restore(self, path: str) -> tuple[int, dict]:
        state = self.ckpts.read_trainer_state(path)
        self.calls.append(("restore", state["step"]))
        return state["step"], state

    def save(self, step: int) -> None:
        with self.ckpts.writing(step) as tmp:
            self.ckpts.write_trainer_state(tmp, {"step": step})
        self.calls.append(("save", step))

    def set_lr_scale(self, scale: float) -> None:
        self.calls.append(("lr", scale))

    def log(self, metrics: dict, step: int) -> None:
        self.rows.append((step, dict(metrics)))


def make(tmp_path, supervisor=None, **watchdog) -> tuple[RunControl, FakeRun]:
    ckpts = CheckpointManager(str(tmp_path))
    run = FakeRun(ckpts)
    return RunControl(run, ckpts, RunHealth(), WatchdogConfig(**watchdog), supervisor), run


def test_a_healthy_step_counts_and_carries_the_rollback_count(tmp_path):
    control, run = make(tmp_path)
    metrics = dict(HEALTHY)
    assert control.judge(1, metrics) is None
    assert control.done_step == 1 and metrics[sig.ROLLBACKS] == 0.0
    assert run.calls == []


def test_a_trip_rolls_back_lowers_the_lr_and_marks_the_next_row(tmp_path):
    control, run = make(tmp_path, lr_factor=0.5)
    assert control.judge(1, dict(HEALTHY)) is None
    run.save(1)
    tripped = {**NAN, sig.RETRIEVER_RESTARTS: 1.0}
    assert control.judge(2, tripped) == 1
    assert control.done_step == 1 and run.calls[-2:] == [("restore", 1), ("lr", 0.5)]
    (rollback,) = control.health.rollbacks
    assert (rollback["step"], rollback["restored_step"], list(rollback["trips"])) == (2, 1, ["nonfinite"])
    # the redone step's row carries the trip, where it came from and the rolled-back step's retriever restarts
    again = dict(HEALTHY)
    assert control.judge(2, again) is None
    assert again[sig.trip("nonfinite")] == 1.0 and again[sig.ROLLED_BACK_FROM] == 2.0
    assert again[sig.ROLLBACKS] == 1.0 and again[sig.RETRIEVER_RESTARTS] == 1.0
    later = dict(HEALTHY)
    control.judge(3, later)
    assert sig.trip("nonfinite") not in later  # marks go to one row only


def test_a_second_rollback_halves_again_then_the_cap_stops_the_run(tmp_path):
    control, run = make(tmp_path, max_rollbacks=2)
    run.save(1)
    control.judge(1, dict(HEALTHY))
    assert control.judge(2, dict(NAN)) == 1 and control.judge(2, dict(NAN)) == 1
    assert [c for c in run.calls if c[0] == "lr"] == [("lr", 0.5), ("lr", 0.25)]
    with pytest.raises(RunStopped, match="all 2 rollbacks are used"):
        control.judge(2, dict(NAN))


def test_a_trip_without_a_checkpoint_stops_the_run(tmp_path):
    control, _ = make(tmp_path)
    with pytest.raises(RunStopped, match="no complete checkpoint to roll back to"):
        control.judge(1, dict(NAN))


def test_an_outage_logs_and_saves_the_applied_step_then_advises_resume(tmp_path):
    service = SimpleNamespace(owned=False, url="http://r:8000")
    supervisor = SimpleNamespace(
        service=service, open_outage=lambda: {"down_s": 3.0, "restarts": 0}, step_metrics=lambda: {}
    )
    control, run = make(tmp_path, supervisor=supervisor)
    metrics = dict(HEALTHY)
    control.judge(1, metrics)  # applied; its row not written yet (validation was running)
    stop = control.stopped(RetrieverDownError("retriever.url=http://r:8000 is down\nmore"))
    assert isinstance(stop, RunStopped)
    assert run.rows == [(1, metrics)] and ("save", 1) in run.calls
    text = str(stop)
    assert text.startswith("run stopped during step 2: retriever.url=http://r:8000 is down.")
    assert "Saved the checkpoint of step 1" in text and "retriever.url=http://r:8000 back" in text
    assert "trainer.resume=auto" in text
    assert control.health.stop["step"] == 2 and control.health.outages == [{"step": 2, "down_s": 3.0, "restarts": 0}]


def test_an_outage_before_any_update_saves_nothing(tmp_path):
    control, run = make(tmp_path)
    stop = control.stopped(RetrieverDownError("the retriever is down"))
    assert "Nothing was trained yet" in str(stop) and "Bring the retriever back" in str(stop)
    assert run.calls == [] and run.rows == []


def test_a_logged_step_is_not_logged_again_on_stop(tmp_path):
    control, run = make(tmp_path)
    control.judge(1, dict(HEALTHY))
    control.logged()
    control.stopped(RetrieverDownError("down"))
    assert run.rows == [] and ("save", 1) in run.calls


def test_a_dead_worker_names_the_last_checkpoint_and_other_errors_pass_through(tmp_path):
    import ray

    control, run = make(tmp_path)
    run.save(3)
    control.done_step = 3
    stop = control.stopped(ray.exceptions.WorkerCrashedError())
    assert "during step 4: a Ray worker died (WorkerCrashedError" in str(stop)
    assert f"The last complete checkpoint is {run.ckpts.latest()}" in str(stop)
    assert control.stopped(ValueError("a bug")) is None


def test_supervised_records_the_outages_of_the_body(tmp_path):
    events = []

    @contextlib.contextmanager
    def watching():
        events.append("watch")
        yield

    supervisor = SimpleNamespace(
        check=lambda: events.append("check"), watching=watching, take_outages=lambda: [{"down_s": 1.0}]
    )
    control, _ = make(tmp_path, supervisor=supervisor)
    with pytest.raises(KeyError), control.supervised(5):
        raise KeyError("the step failed")
    assert events == ["check", "watch"] and control.health.outages == [{"step": 5, "down_s": 1.0}]
