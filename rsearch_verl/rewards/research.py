"""ReSearch reward (the ReSearch paper, Eq. 2): F1 of the `\\boxed{}` answer; 0.1 when F1 is 0 but the format is right.

    compute_rewards("research_f1", items)      # r = F1 if F1 > 0; 0.1 if F1 == 0 and format ok; else 0

The answer is the last `\\boxed{…}` inside the last `<answer>` block of the policy text, as Eq. 2 defines it
("the final answer in \\boxed{}" of the answer) and as the protocol's `extract_answer` reads it: a box outside the
answer block (a truncated "<think> maybe \\boxed{Paris}? let me search") is no answer. The paper's format
check "mainly checks the correctness of tags and existence of \\boxed{} in the answer"; ours: every
<think>/<search>/<answer> tag in the policy text is balanced and not nested, exactly one <answer> block which
holds a `\\boxed{}` and ends the response, and no <result> tag written by the policy (a forged retrieval).
"""

from __future__ import annotations

from rsearch_verl.rewards.base import RewardInput, RewardResult, register
from rsearch_verl.rewards.formats import check_block_grammar, count_boxed, extract_boxed, extract_tag, tag_balance
from rsearch_verl.rewards.qa import exact_match, f1_score

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


def research_answer(policy: str) -> str | None:
    """The `\\boxed{}` content of the last `<answer>` block of the policy text; None without one (the one rule the
    reward and the ReSearch protocol share)."""
    block = extract_tag(policy, "answer")
    return extract_boxed(block) if block is not None else None


@register("research_f1")
def research_f1(items: list[RewardInput], judge_cfg: object = None) -> list[RewardResult]:
    results = []
    for item in items:
        policy = item.policy_text()
        answer = research_answer(policy)
        f1 = f1_score(answer, item.golds)
        fmt = format_ok(policy)
        score = f1 if f1 > 0 else (0.1 if fmt else 0.0)
        metrics = {"f1": f1, "em": exact_match(answer, item.golds), "format": float(fmt)}
        results.append(RewardResult(score=float(score), metrics=metrics, answer=answer))
    return results
