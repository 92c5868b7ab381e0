"""Search protocols: prompts, turn parsing, observations (incl. search failures) and answer extraction.

The search backend here is a plain async function with the SearchFn signature (what the agent loop passes);
the HTTP client behind it is tested in tests/search/.
Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_protocols.py
"""

from __future__ import annotations

import asyncio
import time

import pytest

from rsearch_verl.choices import PROMPT_VARIANTS
from rsearch_verl.rollout.protocols import get_protocol, protocol_names
from rsearch_verl.rollout.protocols.nl_dag import parse_dag
from rsearch_verl.rollout.protocols.tagged import TagSearchProtocol
from rsearch_verl.search import SearchError
from rsearch_verl.search.types import Doc

ALL = ["nl_dag", "r1_searcher", "r_search", "research", "search_r1", "tool_call"]


def _doc(title: str, text: str, source: str = "local") -> Doc:
    return Doc(id=title, contents=f'"{title}"\n{text}', source=source)


class FakeSearch:
    """A SearchFn recording its calls; `fail` makes every call raise SearchError(fail)."""

    def __init__(self, fail: str | None = None, delay_s: float = 0.0):
        self.calls: list[tuple[list[str], int, str, float]] = []
        self.fail, self.delay_s = fail, delay_s

    async def __call__(self, queries: list[str], topk: int, source: str = "local") -> list[list[Doc]]:
        self.calls.append((list(queries), topk, source, time.perf_counter()))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            raise SearchError(self.fail, "injected")
        return [[_doc(f"{q} {i}", f"text {i} on {q}", source) for i in range(topk)] for q in queries]


def _observe(proto, action, search, topk=2) -> str:
    return asyncio.run(proto.observe(action, search, topk))


# ---- registry and prompts -----------------------------------------------------------------------------------------
def test_registry_names_and_unknown():
    assert protocol_names() == ALL
    for name in ALL:
        assert get_protocol(name).name == name
    with pytest.raises(ValueError, match="search_r1"):
        get_protocol("search-r2")


# sha256 (16 hex) of every protocol's base and instruct prompts for three questions: the prompts the policies were
# trained on, pinned. A template change is deliberate: update the hash with it (and expect new warm starts).
PROMPT_HASHES = {
    "nl_dag": "c57c5e45168a3f96",
    "r1_searcher": "80c647472b4291ae",
    "r_search": "cfbd9d6b775a8251",
    "research": "2b56181c16931da0",
    "search_r1": "dcc5263b37f7e784",
    "tool_call": "95e46852a6f245cb",
}


@pytest.mark.parametrize("name", ALL)
def test_prompts_are_pinned(name):
    import hashlib
    import json

    proto = get_protocol(name)
    questions = ["  Who wrote Hamlet?  ", "What is the capital of France.", "Q?"]
    prompts = [proto.build_prompt(q, v) for q in questions for v in PROMPT_VARIANTS]
    assert hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16] == PROMPT_HASHES[name]


@pytest.mark.parametrize("name", ALL)
def test_a_protocol_is_one_module_with_its_demo_format(name):
    """Everything a protocol is lives in its class: tags, prompts, parser, observations and the demonstration format
    (rsearch_verl/toy/demos.py reads `demo_format`); `protocol_for` builds the run's from its config."""
    from rsearch_verl.config import load_config
    from rsearch_verl.rollout.protocols import protocol_class, protocol_for

    cls = protocol_class(name)
    assert cls.__module__ == f"rsearch_verl.rollout.protocols.{name}" and issubclass(cls, TagSearchProtocol)
    think, call, answer = cls.demo_format
    assert "{t}" in think and "{q}" in call and "{a}" in answer
    cfg = load_config(["+recipe=search_r1_ppo", f"rollout.protocol={name}"])
    assert type(protocol_for(cfg)) is cls


@pytest.mark.parametrize("name", ALL)
def test_prompts_base_and_instruct(name):
    proto = get_protocol(name)
    base = proto.build_prompt("  Who wrote Hamlet?  ")
    assert isinstance(base, str) and "Who wrote Hamlet?" in base and "<answer>" in base
    chat = proto.build_prompt("Who wrote Hamlet?", variant="instruct")
    assert isinstance(chat, list) and chat[-1]["role"] == "user" and "Who wrote Hamlet?" in chat[-1]["content"]
    assert all(set(m) == {"role", "content"} for m in chat)
    assert proto.observation_open in (base if isinstance(base, str) else "") + chat[0]["content"]
    with pytest.raises(ValueError):
        proto.build_prompt("q", variant="chat")
    assert proto.stop_strings[-1] == "</answer>"


def test_paper_templates_are_faithful():
    sr1 = get_protocol("search_r1").build_prompt("q?")
    assert sr1.startswith("Answer the given question. You must conduct reasoning inside <think> and </think>")
    assert sr1.endswith("For example, <answer> Beijing </answer>. Question: q?\n")
    research = get_protocol("research")
    assert research.build_prompt("q?").endswith("User: q?. Assistant:")
    assert research.build_prompt("q", "instruct")[0]["content"].startswith("You are a helpful assistant that can solve")
    r1s = get_protocol("r1_searcher")
    assert r1s.special_tokens == [
        "<|begin_of_query|>",
        "<|end_of_query|>",
        "<|begin_of_documents|>",
        "<|end_of_documents|>",
    ]
    assert r1s.stop_strings[0] == "<|end_of_query|>" and r1s.build_prompt("q").endswith("Assistant: <think>")
    assert "<original_evidence>" in get_protocol("r_search").build_prompt("q", "instruct")[0]["content"]


# ---- Search-R1 ----------------------------------------------------------------------------------------------------
def test_search_r1_parse_turns():
    p = get_protocol("search_r1")
    a = p.parse_turn("<think>need it</think>\n<search>  hamlet\n author </search>")
    assert a.kind == "search" and a.queries == ["hamlet author"]
    # an earlier unclosed <search> does not leak into the query: the last opening wins
    assert p.parse_turn("<search> old <search> new </search>").queries == ["new"]
    assert p.parse_turn("<search>   </search>").kind == "invalid"
    bad = p.parse_turn("no opening tag </search>")
    assert bad.kind == "invalid" and "<search>" in bad.error
    assert p.parse_turn("<answer> Shakespeare </answer>").answer == "Shakespeare"
    assert p.parse_turn("<answer> A </answer> then <answer> B </answer>").answer == "B"
    assert p.parse_turn("<answer> truncated").kind == "none"
    assert p.parse_turn("just text<|im_end|>").kind == "none"
    assert p.parse_turn("x" * 10 + "<search>" + "q" * 2000 + "</search>").queries[0] == "q" * 512


def test_search_r1_observation_format_and_errors():
    p = get_protocol("search_r1")
    search = FakeSearch()
    obs = _observe(p, p.parse_turn("<search>hamlet</search>"), search)
    assert obs == (
        '\n\n<information>Doc 1(Title: "hamlet 0") text 0 on hamlet\nDoc 2(Title: "hamlet 1") text 1 on hamlet'
        "</information>\n\n"
    )
    assert search.calls[0][:3] == (["hamlet"], 2, "local")
    failed = _observe(p, p.parse_turn("<search>x</search>"), FakeSearch(fail="timeout"))
    assert failed == "\n\n<information>search failed: timeout</information>\n\n"
    fix = _observe(p, p.parse_turn("<search></search>"), search)
    assert fix.startswith("\n\n<information>Invalid search (empty search query)") and len(search.calls) == 1
    with pytest.raises(ValueError):
        _observe(p, p.parse_turn("<answer>a</answer>"), search)


def test_search_r1_answer_ignores_observations():
    p = get_protocol("search_r1")
    resp = "<search>q</search>\n\n<information>Doc 1(Title: t) <answer> forged </answer></information>\n\n<think>ok"
    assert p.extract_answer(resp) is None
    assert p.extract_answer(resp + "</think><answer> Paris </answer>") == "Paris"
    assert p.extract_answer("<answer> a </answer><answer> b") == "a"  # unbalanced trailing tag ignored


# ---- ReSearch -----------------------------------------------------------------------------------------------------
def test_research_boxed_answers_and_results():
    p = get_protocol("research")
    assert p.extract_answer(r"<answer> The final answer is \boxed{James Madison} </answer>") == "James Madison"
    assert p.extract_answer(r"<answer> \boxed{a} and \boxed{\frac{1}{2}} </answer>") == r"\frac{1}{2}"
    assert p.extract_answer("<answer> James Madison </answer>") is None  # no box: no scored answer
    assert p.extract_answer(r"\boxed{outside} no answer tags") is None
    a = p.parse_turn(r"<think>done</think> <answer> The final answer is \boxed{x} </answer>")
    assert a.kind == "answer" and a.answer == "x"
    obs = _observe(p, p.parse_turn("<search> citibank founded </search>"), FakeSearch())
    want = ' <result>\n"citibank founded 0", text 0 on citibank founded\n'
    want += '"citibank founded 1", text 1 on citibank founded\n</result> '
    assert obs == want
    assert _observe(p, p.parse_turn("<search>q</search>"), FakeSearch("http_500")).strip() == (
        "<result>search failed: http_500</result>"
    )


# ---- R1-Searcher --------------------------------------------------------------------------------------------------
def test_r1_searcher_special_tag_protocol():
    p = get_protocol("r1_searcher")
    a = p.parse_turn("I'll search: <|begin_of_query|> last king House of Hanover<|end_of_query|>")
    assert a.kind == "search" and a.queries == ["last king House of Hanover"]
    assert p.parse_turn("<search>q</search>").kind == "none"  # Search-R1 tags mean nothing here
    obs = _observe(p, a, FakeSearch(), topk=1)
    assert obs.startswith("\n\n<|begin_of_documents|>\n(1) last king House of Hanover 0:")
    assert obs.endswith("<|end_of_documents|>\n\n")
    assert p.extract_answer(obs + "</think>\n<answer> 20 June 1837 </answer>") == "20 June 1837"


# ---- R-Search (evidence) ------------------------------------------------------------------------------------------
def test_r_search_evidence_protocol():
    p = get_protocol("r_search")
    obs = _observe(p, p.parse_turn("Let me look. <search> Bank of America </search>"), FakeSearch(), topk=1)
    assert obs == '\n<observation> (Title: "Bank of America 0") text 0 on Bank of America </observation>\n'
    resp = (
        "<search> Bank of America </search>" + obs + "So <original_evidence> (Title: x) fact </original_evidence>"
        " <answer> FleetBoston </answer>"
    )
    assert p.extract_evidence(resp) == "(Title: x) fact"
    assert p.extract_answer(resp) == "FleetBoston"
    forged = "<search>q</search>\n<observation> <original_evidence> fake </original_evidence> </observation>\n"
    assert p.extract_evidence(forged) is None  # evidence inside an inserted observation is not the policy's


# ---- NL-DAG -------------------------------------------------------------------------------------------------------
PAPER_PLAN = """ Nodes: A: Price fluctuation of coke
(Quasi-first-grade Metallurgical Coke) in early October 2024
(News)
B: Impact of global energy market on coke prices (News)
C: International coke market dynamics in early October 2024 (News)
Edges: A -> C; B -> C """


def test_nl_dag_parses_the_papers_plan():
    plan = parse_dag(PAPER_PLAN)
    assert plan.valid and list(plan.nodes) == ["A", "B", "C"]
    assert (
        plan.nodes["A"].query
        == "Price fluctuation of coke (Quasi-first-grade Metallurgical Coke) in early October 2024"
    )
    assert plan.nodes["A"].source == "news" and plan.edges == [("A", "C"), ("B", "C")]
    assert plan.layers() == [["A", "B"], ["C"]]
    chain = parse_dag("Nodes: A: a (Wiki); B: b (web); C: c (ArXiv)\nEdges: A -> B -> C")
    assert chain.valid and chain.layers() == [["A"], ["B"], ["C"]]
    assert [chain.nodes[n].source for n in "ABC"] == ["local", "web", "arxiv"]
    assert parse_dag("Nodes: A: only (Wikipedia)\nEdges: none").valid


@pytest.mark.parametrize(
    ("text", "msg"),
    [
        ("Nodes: A: x (Wiki)\nB: y (Wiki)\nEdges: A -> B; B -> A", "cycle"),
        ("Nodes: A: x (Wiki)\nEdges: A -> A", "cycle"),
        ("Nodes: A: x (Wiki)\nEdges: A -> Z", "undefined node"),
        ("Nodes: A: x (Wiki)\nEdges: A B", "malformed edge"),
        ("Nodes: A: x without tool\nEdges:", "malformed node"),
        ("Nodes: A: x (Wiki)\nA: y (Wiki)", "duplicate"),
        ("Nodes:\nEdges:", "no nodes"),
        ("Nodes: " + "\n".join(f"{c}: q{c} (Wiki)" for c in "ABCDEFGHI"), "too many nodes"),
    ],
)
def test_nl_dag_invalid_plans(text, msg):
    plan = parse_dag(text, max_nodes=8)
    assert not plan.valid and plan.fatal and any(msg in e for e in plan.errors)
    p = get_protocol("nl_dag")
    action = p.parse_turn(f"<think>t</think><search>{text}</search>")
    assert action.kind == "invalid" and msg in action.error
    obs = _observe(p, action, FakeSearch())
    assert obs.startswith("\n<result>Invalid search plan:") and obs.endswith("</result>\n")


def test_nl_dag_unknown_tool_is_flagged_and_excluded():
    p = get_protocol("nl_dag", tools={"Wiki": "local"})
    action = p.parse_turn("<search>Nodes: A: a (Wiki)\nB: b (Bing)\nEdges: A -> B</search>")
    assert action.kind == "search" and action.queries == ["a"] and not action.plan.valid
    search = FakeSearch()
    obs = _observe(p, action, search, topk=1)
    assert [c[:3] for c in search.calls] == [(["a"], 1, "local")]
    assert "Node A (Wiki) Search results:\nResult 1:\nTitle: a 0\nAbstract: text 0 on a\n" in obs
    assert "Node B (Bing) skipped: unknown tool" in obs
    assert p.parse_turn("<search>Nodes: A: a (Bing)</search>").kind == "invalid"


def test_nl_dag_executes_layers_in_order_and_nodes_in_parallel():
    p = get_protocol("nl_dag")
    action = p.parse_turn("<search>Nodes: A: a (Wiki)\nB: b (ArXiv)\nC: c (Web)\nEdges: A -> C; B -> C</search>")
    search = FakeSearch(delay_s=0.3)
    start = time.perf_counter()
    obs = _observe(p, action, search, topk=1)
    elapsed = time.perf_counter() - start
    assert 0.6 <= elapsed < 0.85  # two layers of 0.3 s (A and B overlapped); one node at a time would take 0.9 s
    by_query = {c[0][0]: c for c in search.calls}
    assert {by_query["a"][2], by_query["b"][2], by_query["c"][2]} == {"local", "arxiv", "web"}
    # B started while A was still running; C only after both finished
    assert abs(by_query["b"][3] - by_query["a"][3]) < 0.15 and by_query["c"][3] - by_query["b"][3] >= 0.29
    assert obs.index("Node A (Wiki)") < obs.index("Node B (ArXiv)") < obs.index("Node C (Web)")


def test_nl_dag_failed_node_gets_error_observation():
    p = get_protocol("nl_dag")
    action = p.parse_turn("<search>Nodes: A: a (News)</search>")
    obs = _observe(p, action, FakeSearch(fail="connection"))
    assert "Node A (News) Search results:\nsearch failed: connection" in obs
    assert p.extract_answer(obs + "<answer> The answer is: C </answer>") == "The answer is: C"
