"""Rewards for the five seed systems, registered by the names recipes use (`reward.name` in YAML).

    from rsearch_verl.rewards import RewardInput, compute_rewards
    item = RewardInput(response=text, segments=[("policy", "..."), ("observation", "..."), ("policy", "...")],
                       ground_truth=["Paris"], question="...", extra={"n_searches": 1})
    results = compute_rewards("search_r1_em", [item])          # -> [RewardResult(score, metrics, answer)]
    compute_rewards("search_r1_em", items, protocol=get_protocol("tool_call"))   # the recipe's protocol
    compute_rewards("r_search_evidence", items, judge_cfg=cfg.reward.judge)   # judge calls batched
    compute_rewards("r_search_evidence", items, judge="f1")                   # offline stand-in (CPU toy runs)

Names: search_r1_em (kwarg format_shaped), research_f1, r1_searcher_stage1, r1_searcher_stage2,
r_search_evidence, r_search_dag. Every reward reads the answer with the protocol's `extract_answer` (the one
answer extractor): `protocol` is the recipe's (the trainer passes `rollout.protocol`), else the paper's protocol the
reward was registered with. Answers and format checks read POLICY text only (`RewardInput.policy_text`: the
"policy" segments joined in order, rsearch_verl/segments.py), never the prompt and never observation text
inserted by the environment. A trajectory without segments (e.g. a plain generation) is all policy text.
"""

from __future__ import annotations

from typing import Any

from rsearch_verl.choices import REWARD_KWARGS
from rsearch_verl.rewards import nl_dag, r1_searcher, r_search, research, search_r1  # noqa: F401 - they register
from rsearch_verl.rewards.base import (
    OBSERVATION,
    PAPER_PROTOCOL,
    POLICY,
    REWARDS,
    RewardFn,
    RewardInput,
    RewardResult,
    register,
)
from rsearch_verl.rollout.protocols import SearchProtocol, get_protocol

if set(REWARDS) != set(REWARD_KWARGS):
    raise ImportError(f"rewards registered {sorted(REWARDS)} != declared in rsearch_verl/choices.py")


def _check_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    allowed = list(REWARD_KWARGS[name])
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(f"reward {name!r} got unknown kwargs {unknown}; it accepts {allowed}")


def compute_rewards(
    name: str,
    items: list[RewardInput],
    judge_cfg: Any = None,
    protocol: SearchProtocol | None = None,
    **kwargs: Any,
) -> list[RewardResult]:
    """Score `items` with the reward registered as `name` (kwargs: the recipe's `reward.kwargs`). Answers are read
    by `protocol.extract_answer`: the recipe's protocol, or (None) the protocol of the reward's paper."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; known: {', '.join(sorted(REWARDS))}")
    fn = REWARDS[name]
    _check_kwargs(name, kwargs)
    if protocol is None:
        protocol = get_protocol(PAPER_PROTOCOL[name])
    results = fn(list(items), judge_cfg, protocol, **kwargs)
    if len(results) != len(items):
        raise RuntimeError(f"reward {name!r} returned {len(results)} results for {len(items)} items")
    return results


__all__ = [
    "OBSERVATION",
    "PAPER_PROTOCOL",
    "POLICY",
    "REWARDS",
    "RewardFn",
    "RewardInput",
    "RewardResult",
    "compute_rewards",
    "register",
]
