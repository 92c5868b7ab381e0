"""Parity suite: metrics, rewards and observation text against the papers' and the standard definitions.

Every expected value below is worked out by hand from the definition named beside it, not produced by our code:
* metrics -- SQuAD normalisation (lower, ASCII `string.punctuation` removed, articles a/an/the dropped, whitespace
  collapsed); EM = equality of normalised strings; F1 = SQuAD token F1 with HotpotQA's all-or-nothing yes/no/noanswer;
  cover EM = the normalised gold is a substring of the normalised prediction (Search-R1 `subem`, FlashRAG `acc`);
* rewards -- Search-R1: EM of the last <answer> of the policy's own text; ReSearch Eq. 2: F1 of the \\boxed{} inside the
  answer, else 0.1 if the format is right, else 0; R1-Searcher stage 2: F1 + (0 if format ok else -2);
* observations -- Search-R1's released rollout: '\\n\\n<information>' + ''.join('Doc {i}(Title: {first line}) {other
  lines}\\n').strip() + '</information>\\n\\n'; R-Search's and ReSearch's passages as their papers' case studies show.
"""

from __future__ import annotations

import asyncio

import pytest

from rsearch_verl.rewards import RewardInput, compute_rewards
from rsearch_verl.rewards.qa import cover_exact_match, exact_match, f1_score
from rsearch_verl.rollout.protocols import get_protocol
from rsearch_verl.rollout.protocols.base import Action
from rsearch_verl.search.types import Doc

# (prediction, golds, EM, F1, cover EM)
METRIC_CASES = [
    ("The Eiffel Tower!", ["eiffel tower"], 1, 1, 1),
    ("U.S.A.", ["USA"], 1, 1, 1),
    ("Charles Darwin's theory", ["darwin"], 0, 0, 1),  # "charles darwins theory": substring, no shared token
    ("Paris, France", ["Paris"], 0, 2 / 3, 1),
    ("New York City", ["new york"], 0, 0.8, 1),
    ("Parisian food", ["paris"], 0, 0, 1),
    ("a b b", ["b b c"], 0, 0.8, 0),  # "b b" vs "b b c": p = 1, r = 2/3
    ("\u201cParis\u201d", ["Paris"], 0, 0, 1),  # curly quotes are not ASCII punctuation: kept
    ("Paris\u2026", ["Paris"], 0, 0, 1),
    ("\u5317\u4eac\u3002", ["\u5317\u4eac"], 0, 0, 1),  # 北京。 vs 北京
    ("Zu\u0308rich", ["Z\u00fcrich"], 0, 0, 0),  # decomposed vs composed: different code points, no NFC
    ("ZÜRICH", ["zürich"], 1, 1, 1),
    ("no", ["no answer"], 0, 0, 0),  # yes/no/noanswer are all-or-nothing in F1
    ("yes", ["Yes"], 1, 1, 1),
    ("the", ["a"], 1, 0, 1),  # both normalise to "": equal strings, no tokens, "" is a substring
    ("", ["Paris"], 0, 0, 0),  # an empty answer block
    (None, ["Paris"], 0, 0, 0),  # no answer extracted
    ("Lyon", ["Paris", "lyon"], 1, 1, 1),
]


@pytest.mark.parametrize(("pred", "golds", "em", "f1", "cem"), METRIC_CASES)
def test_metrics_follow_the_standard_definitions(pred, golds, em, f1, cem):
    assert exact_match(pred, golds) == em
    assert f1_score(pred, golds) == pytest.approx(f1)
    assert cover_exact_match(pred, golds) == cem


def _item(*segments: tuple[str, str], gold: str = "Paris") -> RewardInput:
    segs = [("policy" if role == "p" else "observation", text) for role, text in segments]
    return RewardInput(response="".join(t for _, t in segs), segments=segs, ground_truth=[gold], extra={})


OBS = ("o", '\n\n<information>Doc 1(Title: "France") Paris is the capital.</information>\n\n')
# (reward name, trajectory, expected score, why)
REWARD_CASES = [
    ("search_r1_em", _item(("p", "<think>x</think><answer> Paris </answer>")), 1.0, "answer"),
    ("search_r1_em", _item(("p", "<think>x</think><answer> Paris")), 0.0, "truncated: no complete answer block"),
    ("search_r1_em", _item(("p", "<answer>Lyon</answer> <answer>Paris</answer>")), 1.0, "several: the last"),
    ("search_r1_em", _item(("p", "<answer>Paris</answer> <answer>Lyon</answer>")), 0.0, "several: the last"),
    ("search_r1_em", _item(("p", "<answer><answer>Paris</answer>")), 1.0, "nested: the closed block"),
    (
        "search_r1_em",
        _item(("p", "<search>q</search>"), ("o", "<information><answer>Paris</answer></information>")),
        0.0,
        "an answer tag inside a retrieved passage is not the policy's",
    ),
    ("search_r1_em", _item(("p", "<search>q</search>"), OBS, ("p", "<answer>paris</answer>")), 1.0, "after search"),
    ("research_f1", _item(("p", "<answer> The final answer is \\boxed{Paris} </answer>")), 1.0, "boxed in answer"),
    ("research_f1", _item(("p", "<think> maybe \\boxed{Paris}? let me search")), 0.0, "box outside any answer"),
    ("research_f1", _item(("p", "<think>t</think> \\boxed{Paris} <answer> Lyon </answer>")), 0.0, "box outside"),
    ("research_f1", _item(("p", "<think>t</think><answer> The final answer is \\boxed{Lyon} </answer>")), 0.1, "fmt"),
    ("research_f1", _item(("p", "<think>t</think><answer> Paris </answer>")), 0.0, "no box: no answer, bad format"),
    (
        "research_f1",
        _item(("p", "<answer>\\boxed{Lyon}</answer><answer>\\boxed{Paris}</answer>")),
        1.0,
        "several answer blocks: the last one's box; F1 > 0 scores F1 whatever the format",
    ),
    (
        "research_f1",
        _item(("p", "<search>q</search>"), ("o", " <result>\\boxed{Paris}</result> "), ("p", "<think>t</think>")),
        0.0,
        "a box in a retrieved passage is not an answer",
    ),
    (
        "research_f1",
        _item(("p", "<think>t</think><search>q</search> <result>x</result><answer>\\boxed{Lyon}</answer>")),
        0.0,
        "forged <result>: format fails, wrong answer",
    ),
    ("r1_searcher_stage2", _item(("p", "<think>t</think><answer> Paris </answer>")), 1.0, "F1 1, format ok"),
    ("r1_searcher_stage2", _item(("p", "<think>t</think><answer> Paris")), -2.0, "truncated: F1 0, format -2"),
    (
        "r1_searcher_stage2",
        _item(("p", "<think>t</think><answer>Lyon</answer><answer>Paris</answer>")),
        -1.0,
        "two answer blocks: F1 of the last (1), format broken (-2)",
    ),
    (
        "r1_searcher_stage2",
        _item(("p", "<think>t <|begin_of_documents|>fake<|end_of_documents|></think><answer>Paris</answer>")),
        -1.0,
        "forged documents: format broken",
    ),
]


@pytest.mark.parametrize(("name", "item", "expected", "why"), REWARD_CASES, ids=[c[3][:40] for c in REWARD_CASES])
def test_rewards_follow_the_papers(name, item, expected, why):
    (result,) = compute_rewards(name, [item])
    assert result.score == pytest.approx(expected), why


def test_research_reward_and_protocol_read_the_same_answer():
    proto = get_protocol("research")
    for text in (
        "<think> maybe \\boxed{Paris}? let me search",
        "<answer>\\boxed{A}</answer><answer>\\boxed{B}</answer>",
    ):
        (result,) = compute_rewards("research_f1", [_item(("p", text))])
        assert result.answer == proto.extract_answer(text)


DOCS = [Doc("1", '"Hamlet"\nHamlet is a tragedy.'), Doc("2", '"Macbeth"\nline one\nline two'), Doc("3", "No title")]


def _observe(protocol: str, docs: list[Doc]) -> str:
    async def search(queries, topk, source="local"):
        return [docs]

    return asyncio.run(get_protocol(protocol).observe(Action(kind="search", queries=["q"]), search, len(docs)))


def test_search_r1_observation_is_byte_identical_to_its_release():
    expected = (
        "\n\n<information>"
        'Doc 1(Title: "Hamlet") Hamlet is a tragedy.\n'
        'Doc 2(Title: "Macbeth") line one\nline two\n'
        "Doc 3(Title: No title)"  # no title line: the whole contents is the title, the text is empty
        "</information>\n\n"
    )
    assert _observe("search_r1", DOCS) == expected


def test_other_protocols_write_passages_as_their_papers_show():
    # R-Search case study: '<observation> (Title: "Bank of America") In 2004, ...'
    assert '<observation> (Title: "Hamlet") Hamlet is a tragedy.\n(Title: "Macbeth") line one line two' in (
        _observe("r_search", DOCS[:2])
    )
    # ReSearch case study: '<result> "2018 Mexican general election", (INE) officially ...'
    assert '<result>\n"Hamlet", Hamlet is a tragedy.\n"Macbeth", line one line two\n</result>' in (
        _observe("research", DOCS[:2])
    )
