"""`Trainer.train_step` on fake worker groups: the step's phases run in the recipe's order, each phase's metrics come
out of the step (merged one way, by `StepMetrics`), the update sees what the phases wrote (loss mask, advantages,
the dropped row's uid, the worker arguments), and the rollout's own uid array is not renamed in place.

Run: .venv/bin/python -m pytest -q tests/trainer/test_train_step.py
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from verl import DataProto

from rsearch_verl.config import RSearchConfig
from rsearch_verl.rollout.protocols import protocol_for
from rsearch_verl.testing.batches import sequence_tensors
from rsearch_verl.trainer import phases
from rsearch_verl.trainer.loop import StepMetrics, Trainer


def obj(values: list) -> np.ndarray:
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    return arr


def rollout_batch(b: int = 4, p: int = 3, r: int = 5) -> DataProto:
    """A rollout's batch: two prompts x two samples, row 3's search failed for an outage reason."""
    mask = torch.tensor([[1, 1, 0, 0, 1]] * b)
    ids = torch.arange(b * (p + r)).reshape(b, p + r) % 40 + 5
    tensors = sequence_tensors(ids[:, :p], ids[:, p:], torch.ones(b, p + r, dtype=torch.long), mask)
    del tensors["loss_mask"]  # the driver writes it (rsearch_verl/batch.py)
    tensors.update(rollout_versions=torch.where(mask.bool(), 0, -1), rollout_log_probs=-torch.full((b, r), 0.5))
    answers = ["Paris", "Rome", "Paris", "Paris"]
    segments = [[("policy", "<search> q </search>"), ("observation", "<information> x </information>"),
                 ("policy", f"<answer> {a} </answer>")] for a in answers]  # fmt: skip
    non_tensors = {
        "uid": obj(["a", "a", "b", "b"]),
        "response_text": obj(["".join(t for _, t in s) for s in segments]),
        "segments": obj(segments),
        "ground_truth": obj([["Paris"]] * b),
        "question": obj(["q"] * b),
        "data_source": obj(["toy"] * b),
        "extra_info": obj([{}] * b),
        "n_searches": obj([1] * b),
        "n_turns": obj([2] * b),
        "finish_reason": obj(["answer"] * b),
        "search_failed": obj([False, False, False, True]),
    }
    batch = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
    batch.meta_info["metrics"] = {"search/calls": 4.0}
    return batch


class FakeWorkers:
    """Actor, critic and weight sync in one: records each call and what the update saw."""

    def __init__(self):
        self.calls, self.update_saw = [], {}

    def compute_log_prob(self, batch):
        self.calls.append("old_log_prob")
        return DataProto.from_dict(tensors={"old_log_probs": batch.batch["rollout_log_probs"].clone()})

    def compute_ref_log_prob(self, batch):
        self.calls.append("ref")
        return DataProto.from_dict(tensors={"ref_log_prob": batch.batch["rollout_log_probs"] - 0.1})

    def compute_values(self, batch):
        self.calls.append("values")
        return DataProto.from_dict(tensors={"values": torch.zeros_like(batch.batch["rollout_log_probs"])})

    def update_critic(self, batch):
        self.calls.append("update_critic")
        return DataProto(meta_info={"metrics": {"critic/vf_loss": 0.5}})

    def update_actor(self, batch):
        self.calls.append("update_actor")
        meta = {k: batch.meta_info[k] for k in ("temperature", "kl_coef", "step")}
        self.update_saw = {"meta": meta, "uid": list(batch.non_tensor_batch["uid"]), "batch": batch}
        return DataProto(meta_info={"metrics": {"actor/pg_loss": 0.25}})

    def sync_rollout_weights(self, version: int) -> dict[str, float]:
        self.calls.append(f"sync {version}")
        return {"sync/bytes": 0.0}


def run_step(cfg: RSearchConfig, step: int = 1) -> tuple[dict, FakeWorkers, DataProto]:
    fake, batch = FakeWorkers(), rollout_batch()
    trainer = object.__new__(Trainer)  # the step's own code; the workers, data and pipeline are fakes
    trainer.cfg, trainer.protocol, trainer.run_dir, trainer.tokenizer = cfg, protocol_for(cfg), "", None
    trainer.wg = SimpleNamespace(actor=fake, critic=fake, sync_rollout_weights=fake.sync_rollout_weights,
                                 rollout_idle_seconds=lambda: None)  # fmt: skip
    trainer.rollouts = SimpleNamespace(take=lambda s: fake.calls.append(f"take {s}") or batch)
    return trainer.train_step(step), fake, batch


def _ppo() -> RSearchConfig:
    cfg = RSearchConfig()
    cfg.trainer.dump_rollouts = False
    algorithm = dataclasses.replace(cfg.algorithm, adv_estimator="gae", use_kl_in_reward=True)
    return dataclasses.replace(cfg, algorithm=algorithm)


def test_the_phases_run_in_order_and_their_metrics_come_out_of_the_step():
    metrics, fake, rollout = run_step(_ppo(), step=1)
    assert fake.calls == ["take 1", "old_log_prob", "ref", "values", "update_critic", "update_actor", "sync 1"]
    # one key of each phase: rollout, loss mask, reward, log-prob checks, advantages, updates, sync, timing
    for key in ("search/calls", "rollout/searches_mean", "rollout/dropped_trajectories", "async/staleness_max",
                "reward/mean", "rollout/entropy_mc", "actor/reward_kl", "critic/advantages_mean", "critic/vf_loss",
                "actor/pg_loss", "health/update_skipped", "sync/bytes", "timing/gen_s", "timing/step_s"):  # fmt: skip
        assert key in metrics, key
    assert metrics["reward/mean"] == 0.75 and metrics["rollout/dropped_trajectories"] == 1.0
    assert "metrics" not in rollout.meta_info  # the workers' metrics were taken off the batch, into the step's
    saw = fake.update_saw
    assert saw["meta"] == {"temperature": 1.0, "kl_coef": pytest.approx(0.001), "step": 1}
    assert saw["uid"] == ["a", "a", "b", "b#dropped3"]  # the dropped row left its group in the batch the update saw
    assert saw["batch"].batch["loss_mask"][3].sum() == 0 and saw["batch"].batch["advantages"][3].abs().sum() == 0


def test_the_rollouts_uid_array_is_not_renamed_in_place():
    batch = rollout_batch()
    uids = batch.non_tensor_batch["uid"]
    out, _ = phases.loss_mask_phase(batch, RSearchConfig(), step=1)
    assert list(uids) == ["a", "a", "b", "b"] and list(out.non_tensor_batch["uid"]) == ["a", "a", "b", "b#dropped3"]


def test_step_metrics_merge_in_phase_order_and_time_named_phases():
    rec, batch = StepMetrics(), rollout_batch()
    assert rec.phase("first", lambda b: (b, {"x/a": 1.0}), batch) is batch
    rec.phase(None, lambda b, v: (b, {"x/b": v}), batch, 2.0)  # one more phase: one more line
    assert list(rec.metrics) == ["timing/first_s", "x/a", "x/b"] and rec.metrics["x/b"] == 2.0
