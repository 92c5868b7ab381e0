"""Run control between steps (rsearch_verl/trainer/run_control.py) on real checkpoints: healthy steps count
(`Continue`), a watchdog trip decides a rollback (`RollbackTo`: lr lowered, trip metrics on the next row, rollbacks
capped), errors become a `Stop` with advice, and an outage saves the last applied update first. The control holds no
reference to the run: it returns decisions, and the loop's own code (`Trainer.fit` and the methods it calls, run here on
a scripted trainer) carries them out in order."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest

from rsearch_verl import signals as sig
from rsearch_verl.config import WatchdogConfig
from rsearch_verl.search.breaker import RetrieverDownError
from rsearch_verl.search.store import StoreMismatchError, check_fingerprint
from rsearch_verl.trainer.checkpoint import CheckpointManager
from rsearch_verl.trainer.health import RunStopped
from rsearch_verl.trainer.health.report import RunHealth
from rsearch_verl.trainer.loop import Trainer
from rsearch_verl.trainer.run_control import Continue, RollbackTo, RunControl, Stop

HEALTHY = {sig.PG_LOSS: 0.1, sig.ACTOR_GRAD_NORM: 1.0}
NAN = {sig.PG_LOSS: math.nan, sig.ACTOR_GRAD_NORM: math.nan}


def save(ckpts: CheckpointManager, step: int, health: RunHealth | None = None) -> None:
    with ckpts.writing(step) as tmp:
        ckpts.write_trainer_state(tmp, {"step": step, "health": health.state_dict() if health else None})


def make(tmp_path, supervisor=None, **watchdog) -> RunControl:
    return RunControl(CheckpointManager(str(tmp_path)), RunHealth(), WatchdogConfig(**watchdog), supervisor)


def test_a_healthy_step_counts_and_carries_the_rollback_count(tmp_path):
    control = make(tmp_path)
    metrics = dict(HEALTHY)
    decision = control.judge(1, metrics)
    assert decision == Continue({**HEALTHY, sig.ROLLBACKS: 0.0})
    assert control.done_step == 1 and metrics == HEALTHY  # the caller's metrics are not written into


def test_a_trip_rolls_back_lowers_the_lr_and_marks_the_next_row(tmp_path):
    control = make(tmp_path, lr_factor=0.5)
    assert isinstance(control.judge(1, dict(HEALTHY)), Continue)
    save(control.ckpts, 1)
    tripped = {**NAN, sig.RETRIEVER_RESTARTS: 1.0}
    assert control.judge(2, tripped) == RollbackTo(control.ckpts.latest(), 1, 0.5)
    assert control.done_step == 1
    (rollback,) = control.health.rollbacks
    assert (rollback["step"], rollback["restored_step"], list(rollback["trips"])) == (2, 1, ["nonfinite"])
    # the redone step's row carries the trip, where it came from and the rolled-back step's retriever restarts
    again = control.judge(2, dict(HEALTHY)).row
    assert again[sig.trip("nonfinite")] == 1.0 and again[sig.ROLLED_BACK_FROM] == 2.0
    assert again[sig.ROLLBACKS] == 1.0 and again[sig.RETRIEVER_RESTARTS] == 1.0
    later = control.judge(3, dict(HEALTHY)).row
    assert sig.trip("nonfinite") not in later  # marks go to one row only


def test_a_second_rollback_halves_again_then_the_cap_stops_the_run(tmp_path):
    control = make(tmp_path, max_rollbacks=2)
    save(control.ckpts, 1)
    control.judge(1, dict(HEALTHY))
    first, second = control.judge(2, dict(NAN)), control.judge(2, dict(NAN))
    assert (first.step, first.lr_scale, second.step, second.lr_scale) == (1, 0.5, 1, 0.25)
    stop = control.judge(2, dict(NAN))
    assert isinstance(stop, Stop) and stop.save_step is None
    assert stop.message.startswith("run stopped during step 2: health watchdog tripped at step 2 (")
    assert "all 2 rollbacks are used" in stop.message and "trainer.resume=auto" in stop.message
    assert control.health.stop["step"] == 2


def test_a_trip_without_a_checkpoint_stops_the_run(tmp_path):
    stop = make(tmp_path).judge(1, dict(NAN))
    assert isinstance(stop, Stop) and "no complete checkpoint to roll back to" in stop.message


def test_an_outage_saves_the_applied_step_then_advises_resume(tmp_path):
    service = SimpleNamespace(owned=False, url="http://r:8000")
    supervisor = SimpleNamespace(
        service=service, open_outage=lambda: {"down_s": 3.0, "restarts": 0}, step_metrics=lambda: {}
    )
    control = make(tmp_path, supervisor=supervisor)
    control.judge(1, dict(HEALTHY))  # applied
    stop = control.stopped(RetrieverDownError("retriever.url=http://r:8000 is down\nmore"))
    assert isinstance(stop, Stop) and stop.save_step == 1
    text = stop.message
    assert text.startswith("run stopped during step 2: retriever.url=http://r:8000 is down.")
    assert f"Saved the checkpoint of step 1 ({tmp_path}/checkpoints/step_000001)" in text
    assert "retriever.url=http://r:8000 back" in text and "trainer.resume=auto" in text
    assert control.health.stop["step"] == 2 and control.health.outages == [{"step": 2, "down_s": 3.0, "restarts": 0}]


def test_an_outage_before_any_update_saves_nothing(tmp_path):
    stop = make(tmp_path).stopped(RetrieverDownError("the retriever is down"))
    assert stop.save_step is None
    assert "Nothing was trained yet" in stop.message and "Bring the retriever back" in stop.message


def test_a_dead_worker_names_the_last_checkpoint_and_other_errors_pass_through(tmp_path):
    import ray

    control = make(tmp_path)
    save(control.ckpts, 3)
    control.done_step = 3
    stop = control.stopped(ray.exceptions.WorkerCrashedError())
    assert "during step 4: a Ray worker died (WorkerCrashedError" in stop.message and stop.save_step is None
    assert f"The last complete checkpoint is {control.ckpts.latest()}" in stop.message
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
    control = make(tmp_path, supervisor=supervisor)
    with pytest.raises(KeyError), control.supervised(5):
        raise KeyError("the step failed")
    assert events == ["check", "watch"] and control.health.outages == [{"step": 5, "down_s": 1.0}]


def test_the_decisions_come_back_in_the_order_the_loop_must_act(tmp_path):
    """A run's decisions, in the order they come: each with the control's bookkeeping done before it comes back (the
    rollback and the stop are in the health a checkpoint written for them stores)."""
    control = make(tmp_path, lr_factor=0.5)
    decisions = [control.judge(1, dict(HEALTHY))]
    save(control.ckpts, 1)
    decisions.append(control.judge(2, dict(NAN)))
    assert len(control.health.rollbacks) == 1 and control.done_step == 1  # before the loop restores
    decisions.append(control.judge(2, dict(HEALTHY)))
    decisions.append(control.stopped(RetrieverDownError("down")))
    assert control.health.stop == {"step": 3, "reason": "down"}  # before the loop saves step 2
    assert [type(d) for d in decisions] == [Continue, RollbackTo, Continue, Stop]
    assert (decisions[1].step, decisions[1].lr_scale, decisions[3].save_step) == (1, 0.5, 2)


class ScriptedTrainer:
    """The loop's own code (`Trainer.fit` and what it calls) over scripted steps: what it does is recorded."""

    fit, _run, _commit, _roll_back, _halt, log = (
        Trainer.fit, Trainer._run, Trainer._commit, Trainer._roll_back, Trainer._halt, Trainer.log
    )  # fmt: skip

    def __init__(self, tmp_path, script: dict, total_steps: int, test_freq: int = 0, val_fails: bool = False):
        self.cfg = SimpleNamespace(trainer=SimpleNamespace(total_steps=total_steps, test_freq=test_freq, save_freq=1,
                                                           val_before_train=False))  # fmt: skip
        self.control, self.script, self.val_fails = make(tmp_path, lr_factor=0.5), script, val_fails
        self.events, self.history = [], []
        self.rollouts = SimpleNamespace(applied=lambda: self.events.append("applied"))
        self.metrics = SimpleNamespace(log=lambda metrics, step: None, close=lambda: self.events.append("close"))

    def maybe_resume(self) -> int:
        return 0

    def train_step(self, step: int) -> dict:
        self.events.append(f"train {step}")
        entry = self.script[step].pop(0)
        if isinstance(entry, BaseException):  # the step's rollout failed
            raise entry
        return dict(entry)

    def validate(self) -> dict:
        if self.val_fails:
            raise RetrieverDownError("the retriever is down")
        return {"val/em": 1.0}

    def save(self, step: int) -> None:
        self.events.append(f"save {step}")
        save(self.control.ckpts, step, self.control.health)

    def restore(self, path: str) -> tuple[int, dict]:
        state = self.control.ckpts.read_trainer_state(path)
        self.events.append(f"restore {state['step']}")
        return state["step"], state

    def set_lr_scale(self, scale: float) -> None:
        self.events.append(f"lr {scale}")


def test_the_loop_carries_out_a_rollback_then_commits_each_step_in_order(tmp_path):
    trainer = ScriptedTrainer(tmp_path, {1: [HEALTHY], 2: [NAN, HEALTHY], 3: [HEALTHY]}, total_steps=3, test_freq=3)
    assert trainer.fit() == trainer.history
    assert trainer.events == [
        *("train 1", "applied", "save 1"),
        *("train 2", "restore 1", "lr 0.5"),  # the tripped step: no row, no save
        *("train 2", "applied", "save 2"),
        *("train 3", "applied", "save 3", "close"),
    ]
    assert [row["step"] for row in trainer.history] == [1, 2, 3]
    assert trainer.history[1][sig.ROLLED_BACK_FROM] == 2.0 and trainer.history[2]["val/em"] == 1.0


def test_the_loop_logs_the_applied_step_then_saves_it_when_validation_meets_an_outage(tmp_path):
    trainer = ScriptedTrainer(tmp_path, {1: [HEALTHY], 2: [HEALTHY]}, total_steps=2, test_freq=2, val_fails=True)
    with pytest.raises(RunStopped, match="run stopped during step 3: the retriever is down") as info:
        trainer.fit()
    assert isinstance(info.value.__cause__, RetrieverDownError)
    assert trainer.events[-4:] == ["train 2", "applied", "save 2", "close"]  # save 2: the stop's
    assert [row["step"] for row in trainer.history] == [1, 2] and "val/em" not in trainer.history[1]
    state = trainer.control.ckpts.read_trainer_state(trainer.control.ckpts.latest())
    assert state["step"] == 2 and state["health"]["stop"] == {"step": 3, "reason": "the retriever is down"}


def test_the_loop_stops_when_the_rollbacks_are_used_up(tmp_path):
    trainer = ScriptedTrainer(tmp_path, {1: [NAN]}, total_steps=2)
    with pytest.raises(RunStopped, match="no complete checkpoint to roll back to"):
        trainer.fit()
    assert trainer.events == ["train 1", "close"] and trainer.history == []


def _store_mismatch() -> StoreMismatchError:
    try:
        check_fingerprint("/runs/nq.sqlite", "sha256:recorded", "sha256:served")
    except StoreMismatchError as exc:
        return exc
    raise AssertionError("check_fingerprint did not raise")


def test_a_store_mismatch_in_a_rollout_worker_stops_the_run_naming_both_fingerprints(tmp_path):
    """A StoreMismatchError raised in a rollout worker (a RayTaskError carrying it as its cause) is a Stop with the
    store's message, like a rejected credential, not a crash: the loop halts with RunStopped (exit 3, no traceback)."""
    import ray

    cause = _store_mismatch()
    wrapped = ray.exceptions.RayTaskError("generate_sequences", "Traceback ...", cause)
    control = make(tmp_path)
    control.done_step = 2
    stop = control.stopped(wrapped)
    assert isinstance(stop, Stop) and stop.save_step is None
    assert stop.message.startswith("run stopped during step 3: the record/replay store /runs/nq.sqlite")
    assert "sha256:recorded" in stop.message and "sha256:served" in stop.message
    assert "Point retriever.url at the index the store was recorded from" in stop.message
    assert control.health.stop == {"step": 3, "reason": str(cause)}

    trainer = ScriptedTrainer(tmp_path / "loop", {1: [HEALTHY], 2: [wrapped]}, total_steps=3)
    with pytest.raises(RunStopped, match="sha256:recorded.*sha256:served") as info:
        trainer.fit()
    assert info.value.__cause__ is wrapped
    assert trainer.events == ["train 1", "applied", "save 1", "train 2", "close"]  # nothing saved for the stop
    assert trainer.control.health.summary()["status"] == "stopped"
