"""Driver phases on a hand-built batch: the reward phase reads answers with the recipe's protocol, and the rollout's
per-trajectory statistics (`rollout/*`) are computed once, from the batch, by `phases.rollout_metrics`.

Run: .venv/bin/python -m pytest -q tests/trainer/test_trainer_phases.py
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from verl import DataProto

from rsearch_verl.batch import FINISH_REASONS
from rsearch_verl.config import RSearchConfig
from rsearch_verl.rollout.protocols import protocol_for
from rsearch_verl.trainer import phases

THINKING = [("policy", "<think> maybe <answer> Paris </answer> </think> not sure")]
SEARCHED = [
    ("policy", "<search> capital </search>"),
    ("observation", "<information> <answer> Paris </answer> </information>"),
    ("policy", "<search> again </search>"),
    ("observation", "<information> x </information>"),
    ("policy", "<answer> Paris </answer>"),
]


def obj(values: list) -> np.ndarray:
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):  # element-wise: numpy would turn equal-length lists into a 2-D array
        arr[i] = v
    return arr


def _batch() -> DataProto:
    segments = [THINKING, SEARCHED]
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 0, 1]])
    attention = torch.cat([torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 1, 0, 0, 0], [1] * 6])], dim=1)
    non_tensors = {
        "uid": obj(["u0", "u1"]),
        "response_text": obj(["".join(t for _, t in s) for s in segments]),
        "segments": obj(segments),
        "ground_truth": obj([["Paris"], ["Paris"]]),
        "question": obj(["q", "q"]),
        "data_source": obj(["toy", "toy"]),
        "extra_info": obj([{}, {}]),
        "n_searches": obj([0, 2]),
        "n_turns": obj([1, 3]),
        "finish_reason": obj(["eos", "answer"]),
    }
    tensors = {"responses": torch.zeros(2, 6, dtype=torch.long), "response_mask": mask, "attention_mask": attention}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def _cfg(protocol: str) -> RSearchConfig:
    cfg = RSearchConfig()
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, protocol=protocol))


def test_reward_phase_reads_answers_with_the_recipes_protocol():
    batch, metrics = phases.reward_phase(_batch(), _cfg("search_r1"), protocol_for(_cfg("search_r1")))
    assert list(batch.non_tensor_batch["answer"]) == ["Paris", "Paris"] and metrics["reward/mean"] == 1.0
    # the tool-call recipe's protocol skips reasoning: the answer inside <think> is no answer
    batch, metrics = phases.reward_phase(_batch(), _cfg("tool_call"), protocol_for(_cfg("tool_call")))
    assert list(batch.non_tensor_batch["answer"]) == [None, "Paris"] and metrics["reward/mean"] == 0.5
    assert batch.batch["token_level_scores"][1].tolist() == [0, 0, 0, 0, 0, 1.0]  # on the last policy token


def test_rollout_metrics_from_the_batch():
    stats = phases.rollout_metrics(_batch())
    assert stats["rollout/searches_mean"] == 1.0 and stats["rollout/searches_max"] == 2.0
    assert stats["rollout/turns_mean"] == 2.0
    assert stats["rollout/response_len_mean"] == 4.5  # real response tokens: 3 and 6
    assert stats["rollout/policy_tokens_mean"] == 3.0  # mask-1 tokens: 3 and 3
    assert {k: stats[f"rollout/finish_{k}"] for k in FINISH_REASONS} == {
        "answer": 0.5,
        "eos": 0.5,
        "max_turns": 0.0,
        "length": 0.0,
        "stop": 0.0,
        "context": 0.0,
    }


def test_validation_metrics_per_data_source():
    """EM and searches overall and per data source (a 2-hop question needs two searches: its own mean says if it
    got them)."""
    nt = {
        "uid": obj(["u0", "u1", "u2", "u3"]),
        "answer": obj(["Paris", "Rome", None, "Oslo"]),
        "ground_truth": obj([["Paris"], ["Milan"], ["Bern"], ["Oslo"]]),
        "reward": obj([1.0, 0.0, 0.0, 1.0]),
        "n_searches": np.array([1, 0, 2, 2]),
        "data_source": np.array(["toy_world_1hop", "toy_world_1hop", "toy_world_2hop", "toy_world_2hop"]),
    }
    metrics = phases.validation_metrics(DataProto.from_dict(non_tensors=nt))
    assert metrics["val/em"] == 0.5 and metrics["val/searches_mean"] == 1.25
    assert metrics["val/toy_world_1hop/em"] == 0.5 and metrics["val/toy_world_1hop/searches_mean"] == 0.5
    assert metrics["val/toy_world_2hop/em"] == 0.5 and metrics["val/toy_world_2hop/searches_mean"] == 2.0
