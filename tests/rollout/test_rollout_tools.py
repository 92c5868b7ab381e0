"""Tools (`rollout.tools`, rsearch_verl/rollout/tools/): the `search` tool is today's search bit for bit in every
protocol; the `open` tool against a REAL served chunked index (tests/retrieval/conftest.py's long-document corpus,
`build --chunk-tokens`, `serve --page-tokens`): page i of n, an unknown id, a page past the end, a URL; the `<open>`
tag and tool-call parsing (unknown tool / bad arguments -> invalid); a user's tool named by import path
(tests/rollout/plugin_tools.py) run through `run_trajectory` with a scripted engine; the counts and metrics.

Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_tools.py
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import scripted_hf
from verl import DataProto

from rsearch_verl.config import ConfigError, RSearchConfig, load_config
from rsearch_verl.rollout.agent_loop import CountingSearch, run_trajectory, trajectories_batch
from rsearch_verl.rollout.engines.base import SamplingParams
from rsearch_verl.rollout.protocols import Action, get_protocol, protocol_for
from rsearch_verl.rollout.protocols.tool_call import SEARCH_TOOL
from rsearch_verl.rollout.tools import Tool, build_tools, tool_class
from rsearch_verl.search.breaker import CircuitBreaker
from rsearch_verl.search.client import SearchClient, SearchError
from rsearch_verl.search.types import Doc
from rsearch_verl.trainer.phases import rollout_metrics, validation_metrics

# the long-document fixtures of the retrieval tests, reused (a conftest of another directory is not visible here)
_spec = importlib.util.spec_from_file_location(
    "retrieval_fixtures", Path(__file__).parents[1] / "retrieval/conftest.py"
)
_rf = sys.modules.setdefault("retrieval_fixtures", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_rf)
start_server, documents_corpus, chunked_index, chunked_server = (
    _rf.start_server,
    _rf.documents_corpus,
    _rf.chunked_index,
    _rf.chunked_server,
)

TAG_PROTOCOLS = ["search_r1", "research", "r1_searcher", "r_search"]
# the declaration tool_call handed the chat template before tools were pluggable, as it was written then
OLD_SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the knowledge source; returns the top passages for the query.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to look up (a few keywords)"}},
            "required": ["query"],
        },
    },
}


async def _old_observe(proto, action, search, topk):
    """TagSearchProtocol.observe as it was before tools (the reference the search tool must reproduce)."""
    if action.kind == "invalid":
        return proto.wrap(proto.invalid_text(action))
    try:
        results = await search(action.queries, topk, proto.source)
    except SearchError as exc:
        return proto.wrap(f"search failed: {exc.short()}")
    docs = [d for per_query in results for d in per_query]
    return proto.wrap(proto.format_docs(docs) if docs else proto.empty_results)


def _searcher(kind: str):
    async def search(queries, topk, source="local"):
        if kind == "fail":
            raise SearchError("timeout", "slow")
        if kind == "empty":
            return [[] for _ in queries]
        return [
            [Doc(f"{q}-{i}", f'"{q} {i}"\npassage  {i}\non {q}', doc_id=f"d{i}") for i in range(topk)] for q in queries
        ]

    return search


# ---- search: bit for bit --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [*TAG_PROTOCOLS, "tool_call"])
def test_search_tool_is_the_old_search_bit_for_bit(name):
    cfg = RSearchConfig()
    cfg.rollout.protocol = name
    bound, plain = protocol_for(cfg), get_protocol(name)  # bound to the default rollout.tools=[search]
    assert cfg.rollout.tools == ["search"] and bound.stop_strings == plain.stop_strings
    assert bound.build_prompt("who?", "base") == plain.build_prompt("who?", "base")
    assert bound.build_prompt("who?", "instruct") == plain.build_prompt("who?", "instruct")
    actions = [Action(kind="search", queries=["a b", "c"]), Action(kind="invalid", error="empty search query")]
    for action in actions:
        for kind in ("docs", "empty", "fail"):
            old = asyncio.run(_old_observe(plain, action, _searcher(kind), 2))
            assert asyncio.run(bound.observe(action, _searcher(kind), 2)) == old
    if name == "tool_call":
        assert json.dumps(bound.tools) == json.dumps([OLD_SEARCH_TOOL]) == json.dumps([SEARCH_TOOL])


def test_nl_dag_keeps_its_own_search_and_gains_open():
    proto = get_protocol("nl_dag")
    plan = proto.parse_turn("<search> Nodes: A: hamlet (Wiki)\nEdges: none </search>")
    assert asyncio.run(proto.observe(plan, _searcher("docs"), 1)).startswith("\n<result>\nNode A (Wiki) Search results")
    proto.bind_tools(build_tools(["search", "open"]))
    assert proto.parse_turn("<open> d1 </open>").args == {"id": "d1", "page": 1}


# ---- the open action's syntax ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [*TAG_PROTOCOLS, "nl_dag"])
def test_open_tag_parsed_only_when_open_is_a_tool(name):
    proto = get_protocol(name)
    assert "</open>" not in proto.stop_strings and proto.parse_turn("x <open> atlas 2 </open>").kind == "none"
    proto.bind_tools(build_tools(["search", "open"]))
    assert proto.stop_strings[-1] == "</open>" and "</open>" not in type(proto).stop_strings
    assert "<open> doc-id [page] </open>" in str(proto.build_prompt("q", "instruct"))
    cases = {
        "<think> t </think> <open> atlas 2 </open>": {"id": "atlas", "page": 2},
        "<open>atlas</open>": {"id": "atlas", "page": 1},
        "<open> wiki:Café Ünïcode page 3 </open>": {"id": "wiki:Café Ünïcode", "page": 3},
        "<open> delta#7 </open>\n": {"id": "delta#7", "page": 1},
    }
    for text, args in cases.items():
        action = proto.parse_turn(text)
        assert (action.kind, action.tool, action.args) == ("tool", "open", args)
    for text, error in {"atlas </open>": "</open> without <open>", "<open>  </open>": "empty document id",
                        "<open> atlas 0 </open>": "must be >= 1"}.items():  # fmt: skip
        action = proto.parse_turn(text)
        assert action.kind == "invalid" and error in action.error and action.tool == "open"
    assert proto.parse_turn(f"{proto.query_open} q {proto.query_close}").kind in ("search", "invalid")  # unchanged


# ---- tool_call: every tool declared, parsed by name ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fmt", "call"),
    [
        ("hermes", '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>'),
        ("llama3_json", '{"name": "%s", "parameters": %s}'),
    ],
)
def test_tool_call_parses_tool_names(fmt, call):
    proto = get_protocol("tool_call", call_format=fmt)
    proto.bind_tools(build_tools(["search", "open", "plugin_tools:Calculator"]))
    assert [t["function"]["name"] for t in proto.tools] == ["search", "open", "calculator"]
    assert proto.stop_strings == get_protocol("tool_call", call_format=fmt).stop_strings
    opened = proto.parse_turn(call % ("open", '{"id": "atlas", "page": 2}'))
    assert (opened.kind, opened.tool, opened.args) == ("tool", "open", {"id": "atlas", "page": 2})
    calc = proto.parse_turn(call % ("calculator", '{"expression": "1+2"}'))
    assert (calc.kind, calc.tool) == ("tool", "calculator")
    assert proto.parse_turn(call % ("search", '{"query": "x"}')).queries == ["x"]
    unknown = proto.parse_turn(call % ("browse", '{"url": "x"}'))
    assert unknown.kind == "invalid" and "unknown tool 'browse'; the tools are 'search', 'open', 'calculator'" in (
        unknown.error
    )
    for args, error in [('{"page": 2}', "needs the argument(s) 'id'"), ('{"id": "a", "page": "two"}', "integer")]:
        bad = proto.parse_turn(call % ("open", args))
        assert bad.kind == "invalid" and error in bad.error
        assert asyncio.run(proto.observe(bad, _searcher("docs"), 1)).count("Invalid tool call") == 1
    only_search = get_protocol("tool_call", call_format=fmt).parse_turn(call % ("open", '{"id": "a"}'))
    assert only_search.error == "unknown tool 'open'; the only tool is 'search'"  # the default run: as before


def test_qwen3_xml_types_parameters_by_schema():
    proto = get_protocol("tool_call", call_format="qwen3_xml")
    proto.bind_tools(build_tools(["search", "open"]))
    xml = "<tool_call>\n<function=open>\n<parameter=id>\natlas\n</parameter>\n<parameter=page>\n3\n</parameter>\n"
    action = proto.parse_turn(xml + "</function>\n</tool_call>")
    assert (action.kind, action.args) == ("tool", {"id": "atlas", "page": 3})


# ---- open against a real chunked index ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def docs_client(chunked_server):
    cfg = RSearchConfig()
    cfg.retriever.url, cfg.retriever.token, cfg.retriever.topk = chunked_server.url, _rf.DOCS_TOKEN, 2
    return cfg, SearchClient(cfg.retriever, backoff_s=0.01)


def _open_proto():
    proto = get_protocol("search_r1")
    proto.bind_tools(build_tools(["search", "open"]))
    return proto


def test_open_reads_pages_of_a_served_document(docs_client, documents_corpus):
    cfg, client = docs_client
    proto, counted = _open_proto(), CountingSearch(client)
    words = documents_corpus[1]["atlas"].split("\n", 1)[1].split()
    pages = math.ceil(len(words) / _rf.PAGE_TOKENS)

    async def run():
        found = await proto.observe(proto.parse_turn("<search> quokka saffron lighthouse </search>"), counted, 2)
        first = await proto.observe(proto.parse_turn("<open> atlas </open>"), counted, 2)
        last = await proto.observe(proto.parse_turn(f"<open> atlas {pages} </open>"), counted, 2)
        past = await proto.observe(proto.parse_turn(f"<open> atlas {pages + 1} </open>"), counted, 2)
        unknown = await proto.observe(proto.parse_turn("<open> no-such-doc </open>"), counted, 2)
        url = await proto.observe(proto.parse_turn("<open> https://example.org/a </open>"), counted, 2)
        held = CountingSearch(CircuitBreaker(client, cfg.retriever.breaker))  # the rollout's own stack
        assert [p.id for p in await held.documents(["atlas", "short"], 0)] == ["atlas", "short"] and held.pages == 2
        await client.aclose()
        return found, first, last, past, unknown, url

    found, first, last, past, unknown, url = asyncio.run(run())
    assert "[id: atlas]" in found  # search results show the id open takes (a chunk's document)
    assert first.startswith("\n\n<information>Document atlas (Title: Atlas)\n")
    assert first.endswith(f"\npage 1 of {pages}</information>\n\n")
    body = first.removeprefix("\n\n<information>").removesuffix("</information>\n\n")
    text = body.split("\n", 1)[1].rsplit("\n", 1)[0]  # between the header line and "page 1 of n"
    assert text.split() == words[: _rf.PAGE_TOKENS]  # the page's text: the document's first page-tokens words
    assert last.endswith(f"page {pages} of {pages}</information>\n\n") and words[-1] in last
    assert f"page {pages + 1} is past the end of document 'atlas' (it has {pages} pages" in past
    assert "no document 'no-such-doc'" in unknown
    assert "fetching URLs is not available in this run" in url
    assert (counted.pages, counted.errors) == (2, 2)  # two pages read; the 422 and the 404 counted, the URL never sent


def test_open_through_run_trajectory_counts_opens_and_pages(docs_client, tok, model):
    cfg, client = docs_client
    cfg.rollout.tools = ["search", "open"]
    cfg.rollout.max_turns, cfg.rollout.max_tokens_per_turn = 4, 48
    cfg.rollout.max_obs_length, cfg.rollout.max_response_length = 1500, 1900
    proto = protocol_for(cfg)

    def script(ctx: str) -> str:
        if "page 2 of" in ctx:
            return "<answer> atlas </answer> junk"
        if "[id: atlas]" in ctx:
            return "<open> atlas 2 </open> junk"
        return "<search> quokka saffron lighthouse </search> junk"

    sampling = SamplingParams(temperature=1.0, max_tokens=48, seed=3)
    for engine in scripted_hf(tok, model, script):
        traj = asyncio.run(run_trajectory(engine, tok, proto, client, tok.encode("Q: where?\n"), cfg, sampling))
    assert (traj.n_searches, traj.n_opens, traj.n_pages_read, traj.finish_reason) == (1, 1, 1, "answer")
    observations = [text for role, text in traj.segments if role == "observation"]
    assert observations[1].startswith("\n\n<information>Document atlas") and "page 2 of " in observations[1]
    assert "junk" not in traj.response_text
    prompts = DataProto.from_dict(non_tensors={"uid": np.array(["u0"], dtype=object)})
    stats = rollout_metrics(trajectories_batch([traj], prompts, tok, {}))
    assert (stats["rollout/opens_mean"], stats["rollout/pages_read_mean"]) == (1.0, 1.0)


def test_validation_metrics_count_opens():
    nt = {
        "answer": ["a", "b"],
        "ground_truth": [["a"], ["c"]],
        "n_searches": [1, 2],
        "reward": [1.0, 0.0],
        "data_source": ["nq", "nq"],
        "n_opens": [0, 3],
        "uid": ["u0", "u1"],
    }
    batch = DataProto.from_dict(non_tensors={k: np.array(v + [None], dtype=object)[:2] for k, v in nt.items()})
    metrics = validation_metrics(batch)
    assert (metrics["val/opens_mean"], metrics["val/em"]) == (1.5, 0.5)


# ---- a user's tool, named by import path ---------------------------------------------------------------------------
def test_plugin_tool_runs_through_run_trajectory(tok, model):
    cfg = RSearchConfig()
    cfg.rollout.tools = ["search", "plugin_tools:Calculator"]
    cfg.rollout.max_turns, cfg.rollout.max_tokens_per_turn = 3, 40
    proto = protocol_for(cfg)
    assert proto.stop_strings == ["</search>", "</answer>", "</calculator>"]
    assert "<calculator> expression </calculator>" in proto.build_prompt("q")

    def script(ctx: str) -> str:
        return "<answer> 14 </answer>" if "= 14" in ctx else "<calculator> 2 * (3 + 4) </calculator> junk"

    sampling = SamplingParams(temperature=1.0, max_tokens=40, seed=1)
    for engine in scripted_hf(tok, model, script):
        traj = asyncio.run(
            run_trajectory(engine, tok, proto, _searcher("docs"), tok.encode("Q: 2*7?\n"), cfg, sampling)
        )
    observations = [text for role, text in traj.segments if role == "observation"]
    assert observations == ["\n\n<information>2 * (3 + 4) = 14</information>\n\n"]
    assert (traj.n_searches, traj.n_opens, traj.finish_reason) == (0, 0, "answer")
    bad = asyncio.run(proto.observe(proto.parse_turn("<calculator> 2 ** 3 </calculator>"), _searcher("docs"), 1))
    assert "calculator failed: only numbers and + - * / ( ) are allowed" in bad


def test_tool_names_are_validated():
    assert issubclass(tool_class("plugin_tools:Calculator"), Tool) and tool_class("open").name == "open"
    with pytest.raises(ValueError, match="not a Tool subclass"):
        tool_class("plugin_tools:NotATool")
    with pytest.raises(ValueError, match="unknown tool 'browse'"):
        tool_class("browse")
    with pytest.raises(ValueError, match="more than one tool named open"):
        build_tools(["open", "open"])
    cfg = load_config(["+recipe=search_r1_grpo", "rollout.tools=[search,open]"])
    assert list(cfg.rollout.tools) == ["search", "open"]
    assert list(load_config(["+recipe=search_r1_grpo"]).rollout.tools) == ["search"]
    for tools, match in [
        ("[search,browse]", "rollout.tools: 'browse' is not one of"),
        ("[open]", "'search' must be one of"),
        ("[search,'no_such_pkg_xyz.tools:X']", "not importable"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(["+recipe=search_r1_grpo", f"rollout.tools={tools}"])
