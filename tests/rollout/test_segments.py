"""One definition of policy text (rsearch_verl/segments.py) and one answer extractor (the protocol's
`extract_answer`), read the same by the protocols, the rewards and the rollout viewer.

The mask rule: a block the policy typed itself (a forged observation, mask 1) is policy text; an answer inside an
observation the environment inserted (mask 0) is never extracted.

Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_segments.py
"""

from __future__ import annotations

import re

import pytest

from rsearch_verl.eval.viewer import render_html
from rsearch_verl.rewards import PAPER_PROTOCOL, RewardInput, compute_rewards
from rsearch_verl.rollout.protocols import get_protocol, protocol_names
from rsearch_verl.segments import OBSERVATION, POLICY, policy_text, segments_from_text

# the reward each protocol's recipes use (offline judge stand-in where the paper's reward needs a judge)
REWARD_OF = {
    "search_r1": ("search_r1_em", {}),
    "tool_call": ("search_r1_em", {}),
    "research": ("research_f1", {}),
    "r1_searcher": ("r1_searcher_stage2", {}),
    "r_search": ("r_search_evidence", {"judge": "f1"}),
    "nl_dag": ("r_search_dag", {"judge": "f1"}),
}


def _answer(protocol: str, value: str) -> str:
    if protocol == "research":  # ReSearch scores only the \boxed{} inside the answer block
        return f"<answer> The final answer is \\boxed{{{value}}} </answer>"
    return f"<answer> {value} </answer>"


def test_policy_text_is_exactly_the_policy_segments():
    segments = [(POLICY, "<search> q </search>"), (OBSERVATION, "<information>d</information>"), (POLICY, "a")]
    assert policy_text(segments) == "<search> q </search>a"
    assert policy_text([]) == ""
    with pytest.raises(ValueError, match="segment role"):
        policy_text([("tool", "x")])
    text = "x <information>d1</information> y <information>d2</information>"
    split = segments_from_text(text, "<information>", "</information>")
    assert split == [
        (POLICY, "x "),
        (OBSERVATION, "<information>d1</information>"),
        (POLICY, " y "),
        (OBSERVATION, "<information>d2</information>"),
    ]
    assert "".join(t for _, t in split) == text
    assert segments_from_text("no tags <information>unclosed", "<information>", "</information>") == [
        (POLICY, "no tags <information>unclosed")
    ]


def test_every_protocol_has_a_paper_reward_and_back():
    assert set(REWARD_OF) == set(protocol_names())
    assert {PAPER_PROTOCOL[name] for name, _ in REWARD_OF.values()} <= set(protocol_names())


@pytest.mark.parametrize("name", protocol_names())
def test_forged_observation_is_policy_text_and_observed_answers_are_never_extracted(name):
    proto = get_protocol(name)
    open_, close = proto.observation_open, proto.observation_close
    forged = [(POLICY, f"I forge a document: {open_} the answer is {_answer(name, 'Lyon')} {close}")]
    observed = [
        (POLICY, "let me look it up "),
        (OBSERVATION, f"{open_} a passage quoting {_answer(name, 'Lyon')} {close}"),
        (POLICY, " nothing more"),
    ]
    assert open_ in policy_text(forged) and close in policy_text(forged)  # the policy typed it: mask 1
    assert proto.extract_answer(forged) == "Lyon"
    assert proto.extract_answer(observed) is None
    # the recipe's reward reads the answer through the same extractor
    reward, kwargs = REWARD_OF[name]
    items = [RewardInput("".join(t for _, t in segs), segs, ["Lyon"]) for segs in (forged, observed)]
    results = compute_rewards(reward, items, protocol=proto, **kwargs)
    assert [r.answer for r in results] == ["Lyon", None]
    # and so does the rollout viewer (segments as the agent loop records them)
    rows = [{"uid": str(i), "segments": [[role, text] for role, text in item.segments]} for i, item in enumerate(items)]
    answers = re.findall(r"answer <b>(.*?)</b>", render_html(rows, step=0, protocol=proto))
    assert answers == ["Lyon", "–"]


def test_rewards_read_answers_with_the_recipes_protocol():
    """search_r1_em on the tool-call recipe reads answers as the tool_call protocol does (reasoning skipped)."""
    segs = [(POLICY, "<think> maybe <answer> Paris </answer> </think> I am not sure")]
    item = RewardInput(segs[0][1], segs, ["Paris"])
    (paper,) = compute_rewards("search_r1_em", [item])  # no protocol given: the paper's (search_r1)
    (tool,) = compute_rewards("search_r1_em", [item], protocol=get_protocol("tool_call"))
    assert (paper.answer, paper.score) == ("Paris", 1.0)
    assert (tool.answer, tool.score) == (None, 0.0)
    assert tool.answer == get_protocol("tool_call").extract_answer(segs)
