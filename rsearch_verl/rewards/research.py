"""ReSearch reward (the ReSearch paper, Eq. 2): F1 of the `\\boxed{}` answer; 0.1 when F1 is 0 but the format is right.

    compute_rewards("research_f1", items)      # r = F1 if F1 > 0; 0.1 if F1 == 0 and format ok; else 0

The answer is the last `\\boxed{…}` inside the last `<answer>` block of the policy text, as Eq. 2 defines it
("the final answer in \\boxed{}" of the answer), read by the protocol's `extract_answer` (the ReSearch protocol's
rule): a box outside the answer block (a truncated "<think> maybe \\boxed{Paris}? let me search") is no answer.
The paper's format check "mainly checks the correctness of tags and existence of \\boxed{} in the answer"; ours: every
<think>/<search>/<answer> tag in the policy text is balanced and not nested, exactly one <answer> block which
holds a `\\boxed{}` and ends the response, and no <result> tag written by the policy (a forged retrieval).
"""

from __future__ import annotations

from rsearch_verl.formats import check_block_grammar, count_boxed, extract_tag, tag_balance
from rsearch_verl.rewards.base import RewardInput, RewardResult, register
from rsearch_verl.rewards.qa import exact_match, f1_score
from rsearch_verl.rollout.protocols import SearchProtocol

_BLOCKS = {"think": ("<think>", "</think>"), "search": ("<search>", "</search>"), "answer": ("<answer>", "</answer>")}
_ANY = {"think", "search", "answer"}


def format_ok(policy: str) -> bool:
    if "<result>" in policy or "</result>" in policy:
        return False
    if tag_balance(policy, "answer") != (1, 1):
        return False
    # free text (the reasoning) may sit between blocks; the answer block must come last
    follows = {"think": _ANY, "search": _ANY}
    ok, _ = check_block_grammar(policy, _BLOCKS, start=_ANY, follows=follows, final={"answer"}, text_between=True)
    if not ok or policy[policy.rindex("</answer>") + len("</answer>") :].strip(" \n.") != "":
        return False
    return count_boxed(extract_tag(policy, "answer")) >= 1


@register("research_f1", protocol="research")
def research_f1(items: list[RewardInput], judge_cfg: object, protocol: SearchProtocol) -> list[RewardResult]:
    results = []
    for item in items:
        policy = item.policy_text()
        answer = item.answer(protocol)
        f1 = f1_score(answer, item.golds)
        fmt = format_ok(policy)
        score = f1 if f1 > 0 else (0.1 if fmt else 0.0)
        metrics = {"f1": f1, "em": exact_match(answer, item.golds), "format": float(fmt)}
        results.append(RewardResult(score=float(score), metrics=metrics, answer=answer))
    return results
