"""R-Search NL-DAG reward (the R-Search NL-DAG paper, Eq. 3): 0.25·format + 0.25·DAG validity + 0.5·answer.

    compute_rewards("r_search_dag", items, judge_cfg=cfg.reward.judge)    # the paper: LLM judge for answers
    compute_rewards("r_search_dag", items, judge="f1")                    # offline stand-in: answer token F1

format (binary): the whole response holds <think>, <search>, <result>, <answer> exactly once each, in that
  order, and the <result> block was inserted by the environment (the policy writing <result> is a forgery).
DAG validity (binary): the <search> content parses as an NL-DAG (`A: query (Tool)` nodes, `A -> B` edges)
  with no cycle, every node well formed, every tool known (`tools`, default the protocol's) and at most
  `max_nodes` nodes — the same parser the rollout executes (rollout/protocols/nl_dag.py).
answer: multiple-choice items (extra["options"] set or extra["question_type"] == "multiple_choice") score the
  F1 between predicted and gold option-letter sets; others get the judge's similarity score in [0, 1]
  (a failed or unparsable judge reply scores 0 with judge_error=1). judge="f1" uses token F1 instead.
"""

from __future__ import annotations

import re

from rsearch_verl.formats import extract_tag
from rsearch_verl.rewards.base import RewardInput, RewardResult, register
from rsearch_verl.rewards.judge import judged_scores
from rsearch_verl.rewards.qa import exact_match, f1_score
from rsearch_verl.rewards.r_search import check_judge_mode
from rsearch_verl.rollout.protocols import SearchProtocol
from rsearch_verl.rollout.protocols.nl_dag import parse_dag

_ORDER = ("think", "search", "result", "answer")
_OPTION = re.compile(r"(?<![A-Za-z])([A-Z])(?![A-Za-z])")
_NUMBER = re.compile(r"\d*\.?\d+")
JUDGE_TEMPLATE = (
    "You are grading an answer to a question against the reference answer(s).\n"
    "Question: {question}\nReference answer(s): {golds}\nPredicted answer: {answer}\n\n"
    "Rate how well the predicted answer matches the meaning and key facts of a reference answer, from 0 "
    "(wrong or missing) to 1 (fully correct). Reply with only the number."
)


def format_ok(item: RewardInput) -> bool:
    policy, full = item.policy_text(), item.full_text()
    if "<result>" in policy or "</result>" in policy:
        return False
    positions = []
    for tag in _ORDER:
        if full.count(f"<{tag}>") != 1 or full.count(f"</{tag}>") != 1:
            return False
        positions += [full.index(f"<{tag}>"), full.index(f"</{tag}>")]
    return positions == sorted(positions)


def option_set(text: str | None) -> set[str]:
    """Option letters in an answer: 'A, C' / '(B)' / 'AC' -> {'A', 'C'}."""
    if not text:
        return set()
    found = set(_OPTION.findall(text))
    compact = text.strip().strip(".")
    if not found and compact.isalpha() and compact.isupper() and len(compact) <= 10:
        found = set(compact)  # "AC": letters written together
    return found


def option_f1(answer: str | None, golds: list[str]) -> float:
    pred, gold = option_set(answer), set().union(*(option_set(g) for g in golds)) if golds else set()
    if not pred or not gold:
        return 0.0
    return 2 * len(pred & gold) / (len(pred) + len(gold))


def is_multiple_choice(item: RewardInput) -> bool:
    return bool(item.extra.get("options")) or item.extra.get("question_type") in ("multiple_choice", "mc")


def parse_judge_score(reply: str | None) -> float | None:
    if reply is None:
        return None
    m = _NUMBER.search(reply)
    if not m:
        return None
    return min(1.0, max(0.0, float(m.group(0))))


def _answer_scores(items, answers, judge: str, judge_cfg) -> list[tuple[float, float]]:
    """(answer score, judge_error) per item; judged items go to the judge as one batch."""
    out = [(0.0, 0.0)] * len(items)
    todo = []
    for i, (item, answer) in enumerate(zip(items, answers, strict=True)):
        if is_multiple_choice(item):
            out[i] = (option_f1(answer, item.golds), 0.0)
        elif not answer:
            out[i] = (0.0, 0.0)
        elif judge == "f1":
            out[i] = (f1_score(answer, item.golds), 0.0)
        else:
            todo.append(i)

    def prompt(i: int) -> str:
        return JUDGE_TEMPLATE.format(question=items[i].question, golds=" | ".join(items[i].golds), answer=answers[i])

    return judged_scores(judge_cfg, todo, prompt, lambda i, reply: parse_judge_score(reply), out, max_tokens=8)


@register("r_search_dag", protocol="nl_dag")
def r_search_dag(
    items: list[RewardInput],
    judge_cfg: object,
    protocol: SearchProtocol,
    *,
    judge: str = "llm",
    tools: dict[str, str] | None = None,
    max_nodes: int = 8,
    weights: tuple[float, float, float] = (0.25, 0.25, 0.5),
) -> list[RewardResult]:
    check_judge_mode(judge, judge_cfg, "r_search_dag")
    w_fmt, w_dag, w_ans = weights
    policies = [item.policy_text() for item in items]
    answers = [item.answer(protocol) for item in items]
    ans_scores = _answer_scores(items, answers, judge, judge_cfg)
    results = []
    for item, policy, answer, (ans, judge_error) in zip(items, policies, answers, ans_scores, strict=True):
        fmt = format_ok(item)
        plan_text = extract_tag(policy, "search")
        dag_valid = plan_text is not None and parse_dag(plan_text, tools=tools, max_nodes=max_nodes).valid
        metrics = {
            "format": float(fmt),
            "dag_valid": float(dag_valid),
            "answer_score": ans,
            "f1": f1_score(answer, item.golds),
            "em": exact_match(answer, item.golds),
            "judge_error": judge_error,
        }
        score = w_fmt * fmt + w_dag * dag_valid + w_ans * ans
        results.append(RewardResult(score=float(score), metrics=metrics, answer=answer))
    return results
