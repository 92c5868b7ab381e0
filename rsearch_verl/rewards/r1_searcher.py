"""R1-Searcher rewards (paper Eq. 1-4): stage 1 = retrieval + format, stage 2 = answer F1 + format penalty.

    compute_rewards("r1_searcher_stage1", items)   # 0.5·[searched at least once] + 0.5·[format ok]
    compute_rewards("r1_searcher_stage2", items)   # F1(answer, gold) + (0 if format ok else -2)

Format rules (the paper's §2.2.1), checked on the whole response (policy text + inserted documents):
1. reasoning in <think>…</think> blocks followed by exactly one <answer>…</answer> (only whitespace outside
   them once retrieval blocks are cut out), the answer ending the response and holding only a short final
   answer (at most `max_answer_words` words, no tags inside);
2. no garbled output (U+FFFD or control characters);
3. queries in <|begin_of_query|>…<|end_of_query|> (inside or between think blocks), balanced, not nested;
   and the policy never writes <|begin_of_documents|> / <|end_of_documents|> itself (forged documents).
The base prompt ends with "Assistant: <think>", so a response whose first think tag is `</think>` counts as
having opened it. `max_answer_words` (default 20) is our bound for "short"; the paper gives no number.
"""

from __future__ import annotations

import re

from rsearch_verl.formats import check_block_grammar, is_garbled, tag_balance
from rsearch_verl.rewards.base import RewardInput, RewardResult, register
from rsearch_verl.rewards.qa import cover_exact_match, exact_match, f1_score
from rsearch_verl.rollout.protocols import SearchProtocol

QUERY = ("<|begin_of_query|>", "<|end_of_query|>")
DOCS = ("<|begin_of_documents|>", "<|end_of_documents|>")
_RETRIEVAL_BLOCKS = {"query": QUERY, "docs": DOCS}
# a query is normally followed by documents, but the environment may refuse one (retrieval budget spent)
_RETRIEVAL_FOLLOWS = {"query": {"query", "docs"}, "docs": {"query"}}
_OUTER_BLOCKS = {"think": ("<think>", "</think>"), "answer": ("<answer>", "</answer>")}
_BLOCK_RE = re.compile("|".join(f"{re.escape(o)}.*?{re.escape(c)}" for o, c in (QUERY, DOCS)), flags=re.DOTALL)


def _with_implicit_think(text: str) -> str:
    close, open_ = text.find("</think>"), text.find("<think>")
    if close >= 0 and (open_ < 0 or close < open_):
        return "<think>" + text
    return text


def format_check(item: RewardInput, answer: str | None, max_answer_words: int = 20) -> tuple[bool, str]:
    """(ok, reason) for the R1-Searcher format rules above; `answer`: the protocol's `extract_answer` of `item`."""
    policy = item.policy_text()
    if DOCS[0] in policy or DOCS[1] in policy:
        return False, "forged documents in policy text"
    if is_garbled(policy):
        return False, "garbled output"
    if policy.count(QUERY[0]) != policy.count(QUERY[1]):
        return False, "unbalanced query tags"
    if tag_balance(policy, "answer") != (1, 1):
        return False, "need exactly one <answer> block"
    full = _with_implicit_think(item.full_text())
    if QUERY[0] in full or DOCS[0] in full:  # retrieval blocks sit inside or between think blocks
        ok, reason = check_block_grammar(
            full, _RETRIEVAL_BLOCKS, {"query"}, _RETRIEVAL_FOLLOWS, final={"query", "docs"}, text_between=True
        )
        if not ok:
            return False, reason
    outer = _BLOCK_RE.sub(" ", full)
    follows = {"think": {"think", "answer"}}
    ok, reason = check_block_grammar(outer, _OUTER_BLOCKS, {"think"}, follows, final={"answer"})
    if not ok:
        return False, reason
    if not answer or "<" in answer or len(answer.split()) > max_answer_words:
        return False, "answer is not one short answer"
    return True, ""


def _base_metrics(item: RewardInput, answer: str | None, fmt: bool) -> dict[str, float]:
    return {
        "f1": f1_score(answer, item.golds),
        "em": exact_match(answer, item.golds),
        "cem": cover_exact_match(answer, item.golds),
        "format": float(fmt),
        "searched": float(item.n_searches() >= 1),
    }


def _scored(items, protocol, max_answer_words: int, score) -> list[RewardResult]:
    """Both stages read the answer and check the format the same way; `score(metrics, fmt)` is the stage's reward."""
    results = []
    for item in items:
        answer = item.answer(protocol)
        fmt, _ = format_check(item, answer, max_answer_words)
        metrics = _base_metrics(item, answer, fmt)
        results.append(RewardResult(score=score(metrics, fmt), metrics=metrics, answer=answer))
    return results


@register("r1_searcher_stage1", protocol="r1_searcher")
def r1_searcher_stage1(
    items: list[RewardInput], judge_cfg: object, protocol: SearchProtocol, *, max_answer_words: int = 20
) -> list[RewardResult]:
    """Stage 1 rewards searching and the format: 0.5 * searched + 0.5 * format."""
    return _scored(items, protocol, max_answer_words, lambda m, fmt: 0.5 * m["searched"] + 0.5 * float(fmt))


@register("r1_searcher_stage2", protocol="r1_searcher")
def r1_searcher_stage2(
    items: list[RewardInput],
    judge_cfg: object,
    protocol: SearchProtocol,
    *,
    max_answer_words: int = 20,
    format_penalty: float = -2.0,
) -> list[RewardResult]:
    """Stage 2 rewards the answer: F1, plus `format_penalty` for a malformed response."""
    return _scored(items, protocol, max_answer_words, lambda m, fmt: m["f1"] + (0.0 if fmt else format_penalty))
