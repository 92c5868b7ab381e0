"""Qwen3.5 / 3.6's tool-call format (`qwen3_xml`, rsearch_verl/rollout/protocols/call_formats.py): the XML form their
templates declare (`<tool_call>`, `<function=search>`, `<parameter=query>`, the value, each closed on its own line;
vLLM's qwen3_coder parser), picked by `model.family` (qwen3_5 / qwen3_5_moe) and by a Qwen3.5 tokenizer under
`call_format=auto`. Malformed calls are "invalid" actions, never exceptions.

Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_qwen3_xml_calls.py
"""

from __future__ import annotations

import pytest

from rsearch_verl.config import load_config
from rsearch_verl.rollout.protocols import get_protocol, protocol_for
from rsearch_verl.rollout.protocols.call_formats import call_format, call_format_for

CALL = "<tool_call>\n<function=search>\n<parameter=query>\n{q}\n</parameter>\n</function>\n</tool_call>"
MALFORMED = [
    ("hermes_json", '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>', "<function=NAME>"),
    ("unknown_tool", CALL.replace("search", "browse").format(q="x"), "unknown tool 'browse'"),
    ("no_query", CALL.replace("query", "q").format(q="x"), "needs <parameter=query>"),
    ("empty_query", CALL.format(q="  "), "empty search query"),
    ("text_between", CALL.replace("</parameter>\n", "</parameter>\nplease\n").format(q="x"), "between the parameters"),
    ("no_open", "<function=search></function>\n</tool_call>", "without <tool_call>"),
    ("bad_list", CALL.format(q='["a", '), "not a JSON list"),
    ("too_many", CALL.format(q='["a", "b", "c", "d"]'), "list of <= 3"),
]


def test_a_call_parses_after_the_reasoning():
    proto = get_protocol("tool_call", enable_thinking=True, call_format="qwen3_xml")
    turn = "the prompt opened <think>, so: hm, look it up</think>\n\n" + CALL.format(q="who wrote  hamlet")
    action = proto.parse_turn(turn)
    assert (action.kind, action.queries) == ("search", ["who wrote hamlet"])
    several = proto.parse_turn(CALL.format(q='["hamlet author", "hamlet year"]'))
    assert several.queries == ["hamlet author", "hamlet year"]
    assert proto.stop_strings[0] == "</tool_call>" and not proto.eos_ends_call
    assert proto.parse_turn(proto.format.example_call("q x")).queries == ["q x"]  # its own example parses
    assert proto.parse_turn("<answer> Shakespeare </answer>").answer.strip() == "Shakespeare"


@pytest.mark.parametrize(("case", "text", "error"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_calls_are_invalid_actions(case, text, error):
    action = call_format("qwen3_xml").parse(text)
    assert action.kind == "invalid" and error in action.error
    shown = get_protocol("tool_call", call_format="qwen3_xml").invalid_text(action)
    assert "<function=search>" in shown  # the observation shows the format's own example


def test_call_inside_unclosed_think_is_invalid_and_prefixes_never_raise():
    fmt = call_format("qwen3_xml")
    assert "inside <think>" in fmt.parse("<think> still thinking " + CALL.format(q="x")).error
    text = "<think> a </think>" + CALL.format(q='["x", "y"]')
    for end in range(len(text) + 1):
        fmt.parse(text[:end].rstrip())


class _Vocab:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


def test_the_format_follows_the_family_and_the_tokenizer():
    for group in ("tiny_qwen3_5", "tiny_qwen3_6_moe", "qwen3_5_9b", "qwen3_6_35b_a3b"):
        cfg = load_config(["+recipe=search_r1_toolcall_grpo", f"model={group}"])
        assert protocol_for(cfg).format.name == "qwen3_xml"
    cfg = load_config(
        ["+recipe=search_r1_toolcall_grpo", "model=tiny_qwen3_5", "+rollout.protocol_kwargs.call_format=hermes"]
    )
    assert protocol_for(cfg).format.name == "hermes"  # the kwargs win
    assert protocol_for(load_config(["+recipe=search_r1_toolcall_grpo", "model=qwen3_4b"])).format.name == "hermes"
    # call_format=auto: Qwen3.5's vocabulary has <think> at 248068, Qwen3's at 151667
    assert call_format_for(_Vocab({"<think>": 248068})) == "qwen3_xml"
    assert call_format_for(_Vocab({"<think>": 151667})) == "hermes"
    proto = get_protocol("tool_call")
    proto.bind_tokenizer(_Vocab({"<think>": 248068}), chat=False)
    assert proto.format.name == "qwen3_xml" and "<parameter=" in proto.base_prompt("q?")
