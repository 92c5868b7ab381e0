"""The health watchdog's signals and the run's health record (pure functions of step metrics; no processes).

Run: .venv/bin/python -m pytest -q tests/trainer/test_trainer_watchdog.py
"""

from __future__ import annotations

import copy
import json
import math

import pytest

from rsearch_verl.config import ConfigError, RSearchConfig, WatchdogConfig, validate
from rsearch_verl.trainer.health.report import RunHealth
from rsearch_verl.trainer.health.watchdog import Watchdog

HEALTHY = {
    "actor/pg_loss": 0.01,
    "actor/grad_norm": 0.3,
    "critic/vf_loss": 0.2,
    "rollout/logprob_abs_diff_mean": 1e-6,
    "rollout/finish_answer": 0.8,
    "rollout/entropy_mc": 0.9,
    "rollout/response_len_mean": 100.0,
}


def _warm(dog: Watchdog, n: int = 3, metrics: dict | None = None) -> None:
    for step in range(1, n + 1):
        assert dog.check(step, metrics or HEALTHY) == {}


@pytest.mark.parametrize("key", ["actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "actor/kl_loss"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nonfinite_loss_or_grad_norm_trips_from_the_first_step(key, value):
    trips = Watchdog(WatchdogConfig()).check(1, {**HEALTHY, key: value})
    assert list(trips) == ["nonfinite"] and not math.isfinite(trips["nonfinite"])


def test_logprob_gap_spike_trips():
    dog = Watchdog(WatchdogConfig(max_logprob_gap=0.5))
    assert dog.check(1, {**HEALTHY, "rollout/logprob_abs_diff_mean": 0.4}) == {}
    assert dog.check(2, {**HEALTHY, "rollout/logprob_abs_diff_mean": 0.7}) == {"logprob_gap": 0.7}
    assert "logprob_gap" in dog.check(3, {**HEALTHY, "rollout/logprob_abs_diff_mean": math.nan})


@pytest.mark.parametrize(
    ("change", "signal"),
    [
        ({"rollout/finish_answer": 0.1}, "answer_collapse"),  # 0.1 < 0.25 x 0.8
        ({"rollout/entropy_mc": 0.05}, "entropy_collapse"),  # 0.05 < 0.1 x 0.9
        ({"rollout/entropy_mc": 3.0}, "entropy_explode"),  # 3.0 > 3 x 0.9
        ({"actor/entropy": 3.0, "rollout/entropy_mc": 0.9}, "entropy_explode"),  # the actor's entropy wins
        ({"rollout/response_len_mean": 301.0}, "length_blowup"),  # > 3 x 100
    ],
)
def test_relative_signals_need_a_baseline_then_trip(change, signal):
    early = Watchdog(WatchdogConfig(min_history=3))
    _warm(early, 2)
    assert early.check(3, {**HEALTHY, **change}) == {}, "2 healthy steps are no baseline yet"
    dog = Watchdog(WatchdogConfig(min_history=3))
    _warm(dog)
    assert list(dog.check(4, {**HEALTHY, **change})) == [signal]


def test_entropy_that_falls_while_the_reward_rises_is_convergence_not_collapse():
    """SmolLM2's first RL steps: entropy 0.06 -> 0.001 nats a token while the reward rose 0.4 -> 0.95."""
    rewarded = {**HEALTHY, "reward/mean": 0.6}
    dog = Watchdog(WatchdogConfig())
    for step in (1, 2, 3):
        assert dog.check(step, rewarded) == {}
    assert dog.check(4, {**rewarded, "rollout/entropy_mc": 0.05, "reward/mean": 0.95}) == {}  # converging
    assert dog.check(5, {**rewarded, "rollout/entropy_mc": 0.05, "reward/mean": 0.6}) == {}  # at its baseline
    tripped = dog.check(6, {**rewarded, "rollout/entropy_mc": 0.05, "reward/mean": 0.3})  # falling: collapse
    assert tripped == {"entropy_collapse": 0.05}


def test_entropy_explode_needs_a_high_entropy_not_only_a_multiple_of_a_tiny_baseline():
    """SmolLM2 at step 9 of a run whose reward had reached 0.95: 0.047 nats a token, 4x a converged baseline."""
    converged = {**HEALTHY, "rollout/entropy_mc": 0.012}
    dog = Watchdog(WatchdogConfig())
    _warm(dog, metrics=converged)
    assert dog.check(4, {**converged, "rollout/entropy_mc": 0.047}) == {}
    assert dog.check(5, {**converged, "rollout/entropy_mc": 0.6}) == {"entropy_explode": 0.6}  # above the floor
    strict = Watchdog(WatchdogConfig(entropy_explode_min=0.0))  # no floor: the relative rule alone
    _warm(strict, metrics=converged)
    assert strict.check(4, {**converged, "rollout/entropy_mc": 0.047}) == {"entropy_explode": 0.047}


def test_normal_variation_does_not_trip_and_tripped_steps_stay_out_of_the_baseline():
    dog = Watchdog(WatchdogConfig())
    _warm(dog)
    wobble = {**HEALTHY, "rollout/finish_answer": 0.5, "rollout/entropy_mc": 0.5, "rollout/response_len_mean": 250.0}
    assert dog.check(4, wobble) == {}
    assert dog.check(5, {**HEALTHY, "actor/grad_norm": math.nan}) == {"nonfinite": pytest.approx(math.nan, nan_ok=True)}
    assert [s for s, _ in dog.history] == [1, 2, 3, 4]
    dog.forget_after(2)  # a rollback to step 2: steps 3 and 4 are redone
    assert [s for s, _ in dog.history] == [1, 2]


def test_disabled_watchdog_never_trips():
    assert Watchdog(WatchdogConfig(enable=False)).check(1, {**HEALTHY, "actor/pg_loss": math.nan}) == {}


def test_health_record_status_reasons_and_round_trip():
    health = RunHealth()
    health.add_step({"retriever/restarts": 0.0, "search/errors": 0.0, "rollout/dropped_trajectories": 0.0})
    assert health.summary()["status"] == "ok" and health.summary()["reasons"] == []
    health.add_step({"retriever/restarts": 1.0, "retriever/down_s": 2.5, "rollout/dropped_trajectories": 3.0})
    health.add_outages([{"down_s": 2.0, "restarts": 1, "recovered": True}], step=4)
    health.add_outages([{"down_s": 0.5, "restarts": 0, "recovered": True}], step=5)
    health.record_rollback(step=6, restored=5, trips={"nonfinite": math.nan}, lr_scale=0.5)
    summary = health.summary()
    assert summary["status"] == "degraded" and summary["retriever_restarts"] == 1 and summary["lr_scale"] == 0.5
    assert summary["dropped_trajectories"] == 3 and [o["step"] for o in summary["outages"]] == [4, 5]
    assert summary["retriever_down_s"] == 2.5
    assert "retriever down 2.5 s in 2 outage(s), 1 restart(s)" in summary["reasons"]
    assert any("rolled back to step 5" in r for r in summary["reasons"])
    json.dumps(summary, allow_nan=False)  # summary.json stays valid JSON (a NaN trip value is written as a string)
    health.record_stop(step=7, reason="the retriever did not answer")
    assert health.summary()["status"] == "stopped"
    resumed = RunHealth()
    resumed.load_state_dict(json.loads(json.dumps(health.state_dict())))
    after = resumed.summary()
    assert after["status"] == "degraded" and after["interruptions"] == [health.stop] and after["lr_scale"] == 0.5
    assert after["retriever_down_s"] == 2.5 and len(after["rollbacks"]) == 1


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("retriever.breaker.failure_rate", 0.0),
        ("retriever.breaker.min_calls", 100),
        ("retriever.supervisor.unhealthy_after", 0),
        ("trainer.watchdog.lr_factor", 1.5),
        ("trainer.watchdog.min_history", 0),
        ("trainer.watchdog.entropy_explode", 1.0),
        ("trainer.watchdog.entropy_explode_min", -0.1),
    ],
)
def test_bad_health_config_names_the_key(key, value):
    cfg = RSearchConfig()
    cfg.rollout.n = 2  # the default estimator (GRPO) needs a group
    validate(copy.deepcopy(cfg))  # valid as it is (validation freezes the copy, not cfg)
    section, *path, leaf = key.split(".")
    node = getattr(cfg, section)
    for name in path:
        node = getattr(node, name)
    setattr(node, leaf, value)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg)
