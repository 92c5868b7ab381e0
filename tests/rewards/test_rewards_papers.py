"""Per-paper rewards on the papers' examples and the nasty cases (offline: judge="f1" where a judge is needed)."""

import pytest

from rsearch_verl.config import JudgeConfig
from rsearch_verl.rewards import REWARDS, RewardInput, compute_rewards


def traj(*parts, golds=("Paris",), question="What is the capital of France?", **extra) -> RewardInput:
    """parts: ("p", policy text) / ("o", observation text) in order."""
    segments = [("policy" if r == "p" else "observation", t) for r, t in parts]
    extra.setdefault("n_searches", sum(1 for r, _ in parts if r == "o"))
    return RewardInput(
        response="".join(t for _, t in parts),
        segments=segments,
        ground_truth=list(golds),
        question=question,
        extra=extra,
    )


def score(name, item, **kw):
    return compute_rewards(name, [item], **kw)[0]


# ---- registry -------------------------------------------------------------------------------------------------
def test_registry_and_errors():
    assert {
        "search_r1_em",
        "research_f1",
        "r1_searcher_stage1",
        "r1_searcher_stage2",
        "r_search_evidence",
        "r_search_dag",
    } <= set(REWARDS)
    with pytest.raises(ValueError, match="known: .*search_r1_em"):
        compute_rewards("nope", [])
    with pytest.raises(ValueError, match="unknown kwargs"):
        compute_rewards("search_r1_em", [], bogus=1)
    with pytest.raises(ValueError, match="reward.judge.url must be set for r_search_evidence"):
        compute_rewards("r_search_evidence", [], judge_cfg=JudgeConfig())
    with pytest.raises(ValueError, match="reward.judge.url must be set for r_search_dag"):
        compute_rewards("r_search_dag", [], judge_cfg=None)
    with pytest.raises(ValueError, match="judge must be one of"):
        compute_rewards("r_search_dag", [], judge="gpt")
    with pytest.raises(ValueError, match="segment role"):
        RewardInput("x", [("tool", "x")], ["a"]).policy_text()


# ---- Search-R1 ------------------------------------------------------------------------------------------------
SR1_GOOD = traj(
    ("p", "<think> I need to search. </think>\n<search> capital of France </search>\n"),
    ("o", "<information>Doc 1(Title: France) Paris is the capital of France.</information>\n"),
    ("p", "<think> It is Paris. </think>\n<answer> Paris </answer>"),
)


def test_search_r1_em_basic_and_multiple_golds():
    r = score("search_r1_em", SR1_GOOD)
    assert (r.score, r.answer, r.metrics["em"]) == (1.0, "Paris", 1.0)
    multi = traj(("p", "<answer>the Big Apple</answer>"), golds=["New York City", "Big Apple"])
    assert score("search_r1_em", multi).score == 1.0
    assert score("search_r1_em", traj(("p", "<answer></answer>"))).score == 0.0
    assert score("search_r1_em", traj(("p", "Paris"))).score == 0.0  # no tag, no answer


def test_search_r1_answer_only_in_observation_or_prompt():
    # the retrieved passage contains an <answer> tag: not the policy's answer
    obs_only = traj(("p", "<search>q</search>"), ("o", "<information><answer>Paris</answer></information>"))
    r = score("search_r1_em", obs_only)
    assert (r.score, r.answer) == (0.0, None)
    # the prompt's example "<answer> Beijing </answer>" is never part of the response
    prompt_example = RewardInput(
        response="I don't know", segments=[("policy", "I don't know")], ground_truth=["Beijing"]
    )
    assert score("search_r1_em", prompt_example).score == 0.0


def test_search_r1_several_answers_last_wins():
    r = score("search_r1_em", traj(("p", "<answer>Lyon</answer> wait <answer>Paris</answer>")))
    assert r.answer == "Paris" and r.score == 1.0


def test_search_r1_format_shaped():
    kw = {"format_shaped": True}
    assert score("search_r1_em", SR1_GOOD, **kw).score == 1.0
    # correct answer, broken structure (free text outside blocks)
    sloppy = traj(("p", "blah <answer>Paris</answer>"))
    assert score("search_r1_em", sloppy, **kw).score == pytest.approx(0.8)
    # valid structure, wrong answer, the gold was in the retrieved text: structure + retrieval
    wrong = traj(
        ("p", "<think>x</think><search>q</search>"),
        ("o", "<information>Paris is the capital.</information>"),
        ("p", "<think>y</think><answer>Lyon</answer>"),
    )
    assert score("search_r1_em", wrong, **kw).score == pytest.approx(0.3)
    # forged observation written by the policy: invalid structure -> only the final-format score
    forged = traj(
        ("p", "<think>x</think><search>q</search><information>Lyon</information><think>y</think><answer>Lyon</answer>")
    )
    r = score("search_r1_em", forged, **kw)
    assert r.score == pytest.approx(0.1) and r.metrics["format"] == 0.0
    assert score("search_r1_em", traj(("p", "<think>unclosed")), **kw).score == 0.0


# ---- ReSearch -------------------------------------------------------------------------------------------------
def test_research_f1_paper_cases():
    good = traj(
        ("p", "<think> search it </think> <search> capital of France </search>"),
        ("o", " <result> Paris is the capital of France. </result> "),
        ("p", "<think> found </think> <answer> The final answer is \\boxed{Paris} </answer>."),
    )
    r = score("research_f1", good)
    assert (r.score, r.answer, r.metrics["format"]) == (1.0, "Paris", 1.0)
    partial = traj(("p", "<think>x</think><answer>The final answer is \\boxed{Paris, Texas}</answer>"))
    assert score("research_f1", partial).score == pytest.approx(2 / 3)
    wrong_ok = traj(("p", "<think>x</think><answer>The final answer is \\boxed{Lyon}</answer>"))
    assert score("research_f1", wrong_ok).score == pytest.approx(0.1)
    no_box = traj(("p", "<think>x</think><answer>Lyon</answer>"))
    assert score("research_f1", no_box).score == 0.0
    unbalanced = traj(("p", "<think>x<answer>\\boxed{Lyon}</answer>"))
    assert score("research_f1", unbalanced).score == 0.0
    two_answers = traj(("p", "<answer>\\boxed{Lyon}</answer><answer>\\boxed{Nice}</answer>"))
    assert score("research_f1", two_answers).score == 0.0
    forged = traj(("p", "<search>q</search><result>Lyon</result><answer>\\boxed{Lyon}</answer>"))
    assert score("research_f1", forged).metrics["format"] == 0.0
    # the answer is the box inside the answer block (Eq. 2): a box anywhere else is no answer
    assert score("research_f1", traj(("p", "\\boxed{Paris}"))).score == 0.0
    # F1 > 0 counts even when the format is wrong (Eq. 2 only looks at format when F1 is 0)
    assert score("research_f1", traj(("p", "<answer>\\boxed{Paris}</answer> trailing"))).score == 1.0


def test_research_nested_boxed_unicode():
    r = score("research_f1", traj(("p", "<answer>\\boxed{\\text{Zürich}}</answer>"), golds=["Zürich"]))
    assert r.answer == "\\text{Zürich}"  # latex kept: F1 compares tokens, "textzürich" != "zürich"
    r = score("research_f1", traj(("p", "<think>t</think><answer>\\boxed{Zürich}</answer>"), golds=["Zürich"]))
    assert r.score == 1.0


# ---- R1-Searcher ----------------------------------------------------------------------------------------------
Q, D = ("<|begin_of_query|>", "<|end_of_query|>"), ("<|begin_of_documents|>", "<|end_of_documents|>")
R1_GOOD = traj(
    ("p", f" I should look it up. {Q[0]} capital France {Q[1]}"),
    ("o", f"{D[0]}\n(1) France: Paris is the capital.\n{D[1]}"),
    ("p", " So it is Paris. </think><answer>Paris</answer>"),  # the base prompt already opened <think>
)


def test_r1_searcher_stage1():
    assert score("r1_searcher_stage1", R1_GOOD).score == 1.0
    no_search = traj(("p", "<think>I know it.</think><answer>Lyon</answer>"))
    r = score("r1_searcher_stage1", no_search)
    assert r.score == 0.5 and r.metrics["format"] == 1.0 and r.metrics["searched"] == 0.0
    bad_fmt = traj(("p", f"{Q[0]}q{Q[1]}"), ("o", f"{D[0]}x{D[1]}"), ("p", "Paris"))
    assert score("r1_searcher_stage1", bad_fmt).score == 0.5


def test_r1_searcher_stage2_and_format_rules():
    assert score("r1_searcher_stage2", R1_GOOD).score == 1.0
    wrong = traj(("p", "<think>x</think><answer>Paris France</answer>"))
    assert score("r1_searcher_stage2", wrong).score == pytest.approx(2 / 3)
    bad = {
        "forged documents": traj(("p", f"<think>x{D[0]}Paris{D[1]}</think><answer>Paris</answer>")),
        "long answer": traj(("p", "<think>x</think><answer>" + "word " * 30 + "Paris</answer>")),
        "two answers": traj(("p", "<think>x</think><answer>Paris</answer><answer>Paris</answer>")),
        "no answer": traj(("p", "<think>x</think> Paris")),
        "garbled": traj(("p", "<think>x\ufffd\ufffd</think><answer>Paris</answer>")),
        "unbalanced query": traj(("p", f"<think>x</think>{Q[0]}q <answer>Paris</answer>")),
        "text after answer": traj(("p", "<think>x</think><answer>Paris</answer> and more")),
        "tag in answer": traj(("p", "<think>x</think><answer><think>Paris</think></answer>")),
    }
    for why, item in bad.items():
        r = score("r1_searcher_stage2", item)
        assert r.metrics["format"] == 0.0, why
        assert r.score == pytest.approx(r.metrics["f1"] - 2.0), why
    assert score("r1_searcher_stage2", bad["long answer"], max_answer_words=64).metrics["format"] == 1.0


# ---- R-Search (multi-reward) ----------------------------------------------------------------------------------
def rs_traj(evidence="- Paris is the capital of France.", answer="Paris"):
    parts = [
        ("p", "I need the capital. <search> capital of France </search>"),
        ("o", "<observation> Paris is the capital and largest city of France. </observation>"),
        ("p", f"<original_evidence>{evidence}</original_evidence> <answer>{answer}</answer>"),
    ]
    return traj(*parts)


def test_r_search_evidence_offline():
    r = score("r_search_evidence", rs_traj(), judge="f1")
    assert r.score == pytest.approx(1.0 + 1.0 + 0.4)
    assert (r.metrics["evidence"], r.metrics["format"]) == (1.0, pytest.approx(0.4))
    r = score("r_search_evidence", rs_traj(evidence="- Lyon is a city."), judge="f1")
    assert r.score == pytest.approx(1.4) and r.metrics["evidence"] == 0.0
    # searched but no evidence block: γa only, no evidence reward
    no_ev = traj(
        ("p", "<search>q</search>"), ("o", "<observation>Paris</observation>"), ("p", "<answer>Paris</answer>")
    )
    assert score("r_search_evidence", no_ev, judge="f1").score == pytest.approx(1.2)
    # no search at all: γe is granted (Eq. 5), answer still counts
    no_search = traj(("p", "<answer>Paris</answer>"))
    assert score("r_search_evidence", no_search, judge="f1").score == pytest.approx(1.4)
    # two answer blocks: I_A = 0
    two = traj(("p", "<answer>Lyon</answer><answer>Paris</answer>"))
    assert score("r_search_evidence", two, judge="f1").metrics["format"] == pytest.approx(0.2)


def test_r_search_forged_observation_gets_no_evidence_reward():
    forged = traj(
        (
            "p",
            "<observation>Paris is the capital.</observation><original_evidence>Paris is the capital."
            "</original_evidence><answer>Paris</answer>",
        ),
        n_searches=0,
    )
    r = score("r_search_evidence", forged, judge="f1")
    assert r.metrics["forged"] == 1.0 and r.metrics["evidence"] == 0.0


# ---- R-Search (NL-DAG) ----------------------------------------------------------------------------------------
DAG = "Nodes:\nA: capital of France (Wiki)\nB: population of Paris (Web)\nEdges: A -> B"


def dag_traj(plan=DAG, answer="Paris", **extra):
    return traj(
        ("p", f"<think> plan it </think>\n<search>\n{plan}\n</search>\n"),
        ("o", "<result>\n[A] Paris is the capital.\n[B] 2.1 million.\n</result>\n"),
        ("p", f"<answer>{answer}</answer>"),
        **extra,
    )


def test_r_search_dag_offline():
    r = score("r_search_dag", dag_traj(), judge="f1")
    assert r.score == pytest.approx(1.0) and r.metrics["dag_valid"] == 1.0 and r.metrics["format"] == 1.0
    cyclic = dag_traj(plan="A: x (Wiki)\nB: y (Wiki)\nEdges: A -> B; B -> A")
    r = score("r_search_dag", cyclic, judge="f1")
    assert r.metrics["dag_valid"] == 0.0 and r.score == pytest.approx(0.75)
    unknown_tool = dag_traj(plan="A: x (Telepathy)")
    assert score("r_search_dag", unknown_tool, judge="f1").metrics["dag_valid"] == 0.0
    assert score("r_search_dag", unknown_tool, judge="f1", tools={"Telepathy": "local"}).metrics["dag_valid"] == 1.0
    wrong = dag_traj(answer="Lyon")
    assert score("r_search_dag", wrong, judge="f1").score == pytest.approx(0.5)


def test_r_search_dag_format_violations():
    forged = traj(("p", f"<think>t</think><search>{DAG}</search><result>fake</result><answer>Paris</answer>"))
    assert score("r_search_dag", forged, judge="f1").metrics["format"] == 0.0
    out_of_order = traj(("p", "<answer>Paris</answer><think>t</think>"))
    r = score("r_search_dag", out_of_order, judge="f1")
    assert r.metrics["format"] == 0.0 and r.metrics["dag_valid"] == 0.0 and r.score == pytest.approx(0.5)


def test_r_search_dag_multiple_choice():
    mc = dag_traj(answer="A, C", golds=["A", "C"], options=["a", "b", "c", "d"])
    assert score("r_search_dag", mc, judge="f1").metrics["answer_score"] == 1.0
    half = dag_traj(answer="(A)", golds=["A", "C"], question_type="multiple_choice")
    assert score("r_search_dag", half, judge="f1").metrics["answer_score"] == pytest.approx(2 / 3)
    compact = dag_traj(answer="AC", golds=["AC"], options=["a", "b", "c"])
    assert score("r_search_dag", compact, judge="f1").metrics["answer_score"] == 1.0
