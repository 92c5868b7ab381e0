"""Tag / boxed extraction and the block-grammar checker."""

import pytest

from rsearch_verl.formats import (
    check_block_grammar,
    count_boxed,
    extract_boxed,
    extract_tag,
    extract_tags,
    is_garbled,
    tag_balance,
)


def test_extract_tag_last_complete_pair():
    assert extract_tag("<answer> a </answer> x <answer>b</answer>", "answer") == "b"
    assert extract_tag("<answer>a</answer> <answer>unclosed", "answer") == "a"
    assert extract_tag("<answer>x<answer>y</answer>", "answer") == "y"
    assert extract_tag("no tags here", "answer") is None
    assert extract_tag("</answer>a<answer>", "answer") is None
    assert extract_tag(None, "answer") is None
    assert extract_tag("<answer>\nmulti\nline\n</answer>", "answer") == "multi\nline"
    assert extract_tag("<answer></answer>", "answer") == ""


def test_extract_tags_order_and_bad_tag():
    assert extract_tags("<s>1</s><s>2</s>", "s") == ["1", "2"]
    with pytest.raises(ValueError):
        extract_tag("x", "<answer>")


def test_tag_balance():
    assert tag_balance("<a>x</a><a>", "a") == (2, 1)
    assert tag_balance("", "a") == (0, 0)


def test_extract_boxed_nested_and_last():
    assert extract_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_boxed(r"The final answer is \boxed{ Paris }.") == "Paris"
    assert extract_boxed(r"\boxed{a{b}c}") == "a{b}c"
    assert extract_boxed(r"\boxed{unbalanced") is None
    assert extract_boxed(r"\boxed{ok} \boxed{broken") == "ok"
    assert extract_boxed(r"\boxed{a \} b}") == r"a \} b"
    assert extract_boxed("nothing") is None
    assert extract_boxed(None) is None
    assert extract_boxed(r"\fbox{x}") == "x"
    assert count_boxed(r"\boxed{1}\boxed{2}") == 2


BLOCKS = {"think": ("<think>", "</think>"), "answer": ("<answer>", "</answer>")}


def test_block_grammar():
    ok = check_block_grammar(
        "<think>t</think> <answer>a</answer>", BLOCKS, {"think"}, {"think": {"answer"}}, {"answer"}
    )
    assert ok == (True, "")
    bad, why = check_block_grammar(
        "<think>t</think> junk <answer>a</answer>", BLOCKS, {"think"}, {"think": {"answer"}}, {"answer"}
    )
    assert not bad and "outside" in why
    bad, why = check_block_grammar(
        "<think><answer>a</answer></think>", BLOCKS, {"think"}, {"think": {"answer"}}, {"answer"}
    )
    assert not bad and "inside" in why
    bad, why = check_block_grammar("<think>t</think>", BLOCKS, {"think"}, {"think": {"answer"}}, {"answer"})
    assert not bad and "end" in why
    bad, _ = check_block_grammar("<answer>a</answer>", BLOCKS, {"think"}, {"think": {"answer"}}, {"answer"})
    assert not bad


def test_is_garbled():
    assert is_garbled("abc\ufffd")
    assert is_garbled("a\x00\x01\x02\x03")
    assert not is_garbled("Zürich — 東京\n\tok")
