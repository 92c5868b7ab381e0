"""Search-R1 reward (the Search-R1 paper): exact match of the answer (the protocol's `extract_answer`: the last
`<answer>` in the policy text for Search-R1; the tool-call recipe's protocol also skips `<think>` blocks).

    compute_rewards("search_r1_em", items)                       # the paper: score = EM ∈ {0, 1}
    compute_rewards("search_r1_em", items, format_shaped=True)   # the released code's v0.3 format-shaped variant

Format-shaped variant, as we implement it (our reading of the released v0.3 scorer; values are kwargs):
the response is "valid" when the whole response (policy + observations) is a sequence of blocks
<think> → (<search> → <information> → <think>)* → <answer>, with only whitespace between blocks, and no
<information> tag written by the policy itself (a forged observation makes it invalid). Then
  EM correct:            1.0 if valid else 1.0 - structure_format_score
  EM wrong / no answer:  structure_format_score (+ retrieval_score when a gold answer appears in a retrieved
                         <information> block) if valid; else final_format_score if an answer was given, else 0.
"""

from __future__ import annotations

import re

from rsearch_verl.formats import check_block_grammar
from rsearch_verl.rewards.base import OBSERVATION, RewardInput, RewardResult, register
from rsearch_verl.rewards.qa import cover_exact_match, exact_match, f1_score
from rsearch_verl.rollout.protocols import SearchProtocol

_BLOCKS = {
    "think": ("<think>", "</think>"),
    "search": ("<search>", "</search>"),
    "information": ("<information>", "</information>"),
    "answer": ("<answer>", "</answer>"),
}
_TAG = re.compile(r"</?[A-Za-z_]+>")
_FOLLOWS = {"think": {"search", "answer"}, "search": {"information"}, "information": {"think"}}


def valid_sequence(item: RewardInput) -> bool:
    """The v0.3 structure check on the whole response; forged <information> in policy text fails it."""
    policy = item.policy_text()
    if "<information>" in policy or "</information>" in policy:
        return False
    ok, _ = check_block_grammar(item.full_text(), _BLOCKS, start={"think"}, follows=_FOLLOWS, final={"answer"})
    return ok


def _retrieval_hit(item: RewardInput) -> bool:
    """A gold answer appears in some retrieved observation (whole-token, normalised)."""
    # tags are cut out first: "<information>Paris" would otherwise normalise to one token "informationparis"
    texts = [_TAG.sub(" ", text) for role, text in item.segments if role == OBSERVATION]
    return any(cover_exact_match(text, item.golds) for text in texts)


def _shaped(em: float, answer: str | None, item: RewardInput, structure: float, final: float, retrieval: float):
    valid = valid_sequence(item)
    if em:
        return (1.0 if valid else 1.0 - structure), valid
    if valid:
        return structure + (retrieval if _retrieval_hit(item) else 0.0), valid
    return (final if answer is not None else 0.0), valid


@register("search_r1_em", protocol="search_r1")
def search_r1_em(
    items: list[RewardInput],
    judge_cfg: object,
    protocol: SearchProtocol,
    *,
    format_shaped: bool = False,
    structure_format_score: float = 0.2,
    final_format_score: float = 0.1,
    retrieval_score: float = 0.1,
) -> list[RewardResult]:
    results = []
    for item in items:
        answer = item.answer(protocol)
        em = exact_match(answer, item.golds)
        metrics = {"em": em, "f1": f1_score(answer, item.golds), "has_answer": float(answer is not None)}
        score = em
        if format_shaped:
            score, valid = _shaped(em, answer, item, structure_format_score, final_format_score, retrieval_score)
            metrics["format"] = float(valid)
        results.append(RewardResult(score=float(score), metrics=metrics, answer=answer))
    return results
