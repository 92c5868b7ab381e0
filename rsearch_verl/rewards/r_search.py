"""R-Search multi-reward (the R-Search multi-reward paper, Eq. 3-8): answer F1 + evidence reward + format reward.

    compute_rewards("r_search_evidence", items, judge_cfg=cfg.reward.judge)   # the paper (cross-family judge)
    compute_rewards("r_search_evidence", items, judge="f1")                   # offline stand-in, NOT the paper's

r = F1(answer, gold) + r_e + r_f, with
  r_e = F1(α_cf, gold) where α_cf is the judge model's answer to the question given ONLY the policy's
        <original_evidence> text (the paper's evidence template, Table 5); 0 when there is no evidence block,
        when the policy forged an <observation> itself (its evidence could quote the forgery), or when the judge
        call failed (metric judge_error=1);
  r_f = (1 − I_S)(γe + γa·I_A) + I_S(γe·I_E + γa·I_A), I_S: a search ran; I_A / I_E: exactly one
        <answer> / <original_evidence> block in the policy text; γe = γa = 0.2 by default.
judge="f1" replaces the judge model with the token recall of the best gold answer in the evidence text: a
cheap, deterministic proxy for CPU toy runs without a judge server.
"""

from __future__ import annotations

from collections import Counter

from rsearch_verl.formats import extract_tag, tag_balance
from rsearch_verl.rewards.base import RewardInput, RewardResult, register
from rsearch_verl.rewards.judge import judged_scores, require_judge_url
from rsearch_verl.rewards.qa import exact_match, f1_score, normalize_answer
from rsearch_verl.rollout.protocols import SearchProtocol

EVIDENCE_TEMPLATE = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nThe following are given passages: {evidence}\n\nQuestion: {query}\n\nAnswer:"
)
JUDGE_MODES = ("llm", "f1")


def evidence_recall(evidence: str, golds: list[str]) -> float:
    """Offline stand-in for the evidence judge: best token recall of a normalised gold in the evidence."""
    ev = Counter(normalize_answer(evidence).split())
    best = 0.0
    for gold in golds:
        toks = normalize_answer(gold).split()
        if toks:
            best = max(best, sum((Counter(toks) & ev).values()) / len(toks))
    return best


def check_judge_mode(judge: str, judge_cfg: object, reward_name: str) -> None:
    if judge not in JUDGE_MODES:
        raise ValueError(f"{reward_name}: judge must be one of {JUDGE_MODES}, got {judge!r}")
    if judge == "llm":
        require_judge_url(judge_cfg, reward_name)


def _evidence_scores(items: list[RewardInput], evidences: list[str | None], judge: str, judge_cfg) -> list:
    """(r_e, judge_error) per item; judge calls for all items with evidence go out as one batch."""
    todo = [i for i, ev in enumerate(evidences) if ev]
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(items)
    if judge == "f1":
        for i in todo:
            out[i] = (evidence_recall(evidences[i], items[i].golds), 0.0)
        return out
    return judged_scores(
        judge_cfg,
        todo,
        lambda i: EVIDENCE_TEMPLATE.format(evidence=evidences[i], query=items[i].question),
        lambda i, reply: f1_score(reply.strip(), items[i].golds),
        out,
    )


@register("r_search_evidence", protocol="r_search")
def r_search_evidence(
    items: list[RewardInput],
    judge_cfg: object,
    protocol: SearchProtocol,
    *,
    judge: str = "llm",
    gamma_e: float = 0.2,
    gamma_a: float = 0.2,
) -> list[RewardResult]:
    check_judge_mode(judge, judge_cfg, "r_search_evidence")
    policies = [item.policy_text() for item in items]
    forged = [("<observation>" in p or "</observation>" in p) for p in policies]
    evidences = [None if f else extract_tag(p, "original_evidence") for p, f in zip(policies, forged, strict=True)]
    ev_scores = _evidence_scores(items, evidences, judge, judge_cfg)
    results = []
    for item, policy, fake, (r_e, judge_error) in zip(items, policies, forged, ev_scores, strict=True):
        answer = item.answer(protocol)
        searched = item.n_searches() >= 1
        i_a = tag_balance(policy, "answer") == (1, 1) and answer is not None
        i_e = (
            tag_balance(policy, "original_evidence") == (1, 1) and extract_tag(policy, "original_evidence") is not None
        )
        r_f = gamma_a * i_a + (gamma_e * i_e if searched else gamma_e)
        f1 = f1_score(answer, item.golds)
        metrics = {
            "f1": f1,
            "em": exact_match(answer, item.golds),
            "evidence": r_e,
            "format": r_f,
            "forged": float(fake),
            "judge_error": judge_error,
        }
        results.append(RewardResult(score=f1 + r_e + r_f, metrics=metrics, answer=answer))
    return results
