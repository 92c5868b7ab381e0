"""The reward record types and the name -> function table every reward module registers itself in.

Moved out of the package's __init__ so the reward modules (search_r1.py, research.py, ...) import these without
importing the package that imports them. `rsearch_verl.rewards` re-exports everything here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rsearch_verl.choices import REWARD_KWARGS, check_parameters
from rsearch_verl.segments import OBSERVATION, POLICY, Segment, policy_text

if TYPE_CHECKING:
    from rsearch_verl.rollout.protocols import SearchProtocol


@dataclass
class RewardInput:
    response: str
    segments: list[tuple[str, str]]  # (role "policy" | "observation", text), in order; joined == response
    ground_truth: list[str]
    question: str = ""
    data_source: str = ""
    extra: dict = field(default_factory=dict)  # extra["n_searches"]: searches the environment executed

    def all_segments(self) -> list[Segment]:
        """The recorded segments, or the whole response as one policy segment when none were recorded."""
        return list(self.segments) if self.segments else [(POLICY, self.response)]

    def policy_text(self) -> str:
        """Everything the policy sampled, observations removed (joined without separators)."""
        return policy_text(self.all_segments())

    def answer(self, protocol: SearchProtocol) -> str | None:
        """The final answer, as `protocol.extract_answer` reads it from the policy segments."""
        return protocol.extract_answer(self.all_segments())

    def full_text(self) -> str:
        """Policy and observation text in order (the whole response)."""
        return "".join(text for _, text in self.segments) if self.segments else self.response

    def n_searches(self) -> int:
        """Searches the environment ran (extra["n_searches"]); counted from observation segments if absent."""
        if "n_searches" in self.extra and self.extra["n_searches"] is not None:
            return int(self.extra["n_searches"])
        return sum(1 for role, _ in self.segments if role == OBSERVATION)

    @property
    def golds(self) -> list[str]:
        gt = self.ground_truth
        return [gt] if isinstance(gt, str) else [str(g) for g in gt]


@dataclass
class RewardResult:
    score: float
    metrics: dict[str, float]
    answer: str | None


# (items, judge_cfg, protocol, **kwargs) -> one result per item, in order
RewardFn = Callable[..., list[RewardResult]]
REWARDS: dict[str, RewardFn] = {}
PAPER_PROTOCOL: dict[str, str] = {}  # reward name -> the protocol of its paper (when no protocol is passed)


def register(name: str, protocol: str) -> Callable[[RewardFn], RewardFn]:
    """Register `fn` as reward `name`, read with `protocol` by default; its keyword-only parameters (its
    `reward.kwargs`) must be the ones rsearch_verl/choices.py declares for `name`, which the config validates."""

    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} registered twice")
        params = inspect.signature(fn).parameters
        check_parameters(REWARD_KWARGS, "reward", name, [p for p, v in params.items() if v.kind == v.KEYWORD_ONLY])
        REWARDS[name], PAPER_PROTOCOL[name] = fn, protocol
        return fn

    return deco
