"""How a model family writes a tool call: one object per format owns its stop strings, its parser, the example and
declaration texts the policy is shown and the demonstration's call. `ToolCallProtocol` (tool_call.py) holds one.

    hermes       Qwen2.5 / Qwen3 / SmolLM2 (Hermes style):
                 <tool_call>\\n{"name": "search", "arguments": {"query": "..."}}\\n</tool_call>
                 generation stops at `</tool_call>`; the template closes the assistant turn (`<|im_end|>`) itself
    llama3_json  Llama 3.1 / 3.2 (JSON tool calling): {"name": "search", "parameters": {"query": "..."}}, optionally
                 after `<|python_tag|>`, ended by the model's own `<|eom_id|>` (a stop string) or `<|eot_id|>` (EOS);
                 results come back in an `ipython` turn. The end token is sampled (policy text), so the observation
                 starts after it, with the ipython header
    qwen3_xml    Qwen3.5 / Qwen3.6 (the qwen3_coder XML form their templates declare):
                 <tool_call>\n<function=search>\n<parameter=query>\n...\n</parameter>\n</function>\n</tool_call>
                 generation stops at `</tool_call>`, as Hermes; a parameter's value is its text (a JSON list of
                 strings for several queries)

    fmt = call_format("llama3_json")
    fmt.parse(text)      # an Action (search / invalid) when `text` (reasoning removed) holds a call, else None
    fmt.example_call("q"), fmt.declaration(tools), fmt.demo_call, fmt.stop_strings, fmt.eos_ends_call

`call_format_for(tokenizer)` names the format of a tokenizer's family (Llama 3's header tokens -> llama3_json; Qwen3.5's
vocabulary -> qwen3_xml), `FAMILY_FORMATS` the format of a `model.family`. Parsing never raises: broken JSON or XML, a
non-object, an unknown tool, missing / empty / non-string arguments and a call inside an unclosed `<think>` are
"invalid" actions whose observation says what was wrong.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rsearch_verl.rollout.protocols.base import Action
from rsearch_verl.rollout.protocols.tagged import MAX_QUERY_CHARS

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN = "<think>"
ANSWER_CLOSE = "</answer>"
PYTHON_TAG = "<|python_tag|>"
LLAMA3_MARKERS = ("<|start_header_id|>", "<|eom_id|>", PYTHON_TAG)  # a tokenizer with these writes llama3_json


def search_action(args: Any, max_queries: int, key: str) -> Action:
    """The search action of a call's arguments (`key`: what the format calls them), or an invalid action saying why."""
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return Action(kind="invalid", error=f"'{key}' is a string that is not a JSON object")
    if not isinstance(args, dict) or "query" not in args:
        return Action(kind="invalid", error=f'the search tool needs "{key}": {{"query": "..."}}')
    query = args["query"]
    queries = query if isinstance(query, list) else [query]
    if not queries or len(queries) > max_queries or not all(isinstance(q, str) for q in queries):
        return Action(kind="invalid", error=f"'query' must be a string (or a list of <= {max_queries})")
    queries = [" ".join(q.split())[:MAX_QUERY_CHARS] for q in queries]
    if not all(queries):
        return Action(kind="invalid", error="empty search query")
    return Action(kind="search", queries=queries)


def tool_action(call: dict, key: str, tools: dict[str, Any]) -> Action:
    """The action of a call naming a tool of the run besides search: its arguments checked against its schema."""
    name, args = call["name"], call.get(key, {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return Action(kind="invalid", error=f"'{key}' is a string that is not a JSON object", tool=name)
    error = tools[name].check_arguments(args)
    if error:
        return Action(kind="invalid", error=error, tool=name)
    return Action(kind="tool", tool=name, args=args)


def _call_action(raw: str, key: str, max_queries: int, tools: dict[str, Any] | None = None) -> Action:
    """The action of one JSON call object `raw` (whole text, nothing after it); `tools`: the run's by name (None:
    search only)."""
    try:
        call = json.loads(raw)
    except json.JSONDecodeError as exc:
        return Action(kind="invalid", error=f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})")
    except (ValueError, RecursionError):  # a number too long to convert, nesting too deep
        return Action(kind="invalid", error="the tool call is not a JSON object this parser accepts")
    if not isinstance(call, dict):
        return Action(kind="invalid", error=f'the tool call must be a JSON object {{"name": …, "{key}": …}}')
    name = call.get("name")
    if name == "search" and (not tools or "search" in tools):
        return search_action(call.get(key), max_queries, key)
    if tools and isinstance(name, str) and name in tools:
        return tool_action(call, key, tools)
    return unknown_tool(name, tools)


def unknown_tool(name: Any, tools: dict[str, Any] | None) -> Action:
    """The invalid action of a call naming no tool of the run."""
    names = list(tools) if tools else ["search"]
    if names == ["search"]:
        return Action(kind="invalid", error=f"unknown tool {name!r}; the only tool is 'search'")
    return Action(kind="invalid", error=f"unknown tool {name!r}; the tools are {', '.join(map(repr, names))}")


def typed_parameters(params: dict[str, str], schema: dict[str, Any]) -> dict[str, Any]:
    """XML parameters (text) as the JSON types their tool's schema declares (an integer's digits become an int)."""
    props = schema.get("properties", {})
    out: dict[str, Any] = {}
    for key, value in params.items():
        kind = props.get(key, {}).get("type")
        if kind in ("integer", "number", "boolean", "array", "object"):
            try:
                out[key] = json.loads(value)
                continue
            except (ValueError, RecursionError):
                pass
        out[key] = value
    return out


def _call_body(text: str) -> str | Action | None:
    """What is inside the last `<tool_call>...</tool_call>` that ends `text`; None when `text` does not end with a call;
    an invalid Action when the call has no opening tag or sits inside an unclosed `<think>` (still reasoning)."""
    if not text.endswith(CALL_CLOSE):
        return None
    body = text[: -len(CALL_CLOSE)]
    start = body.rfind(CALL_OPEN)
    if start < 0:
        return Action(kind="invalid", error=f"{CALL_CLOSE} without {CALL_OPEN}")
    if THINK_OPEN in body[:start]:
        return Action(kind="invalid", error="the tool call is inside <think>; calls go after </think>")
    return body[start + len(CALL_OPEN) :]


class HermesFormat:
    name = "hermes"
    stop_strings = [CALL_CLOSE, ANSWER_CLOSE]
    eos_ends_call = False  # a call ends at `</tool_call>`; EOS ends the trajectory
    sampled_turn_ends: tuple[str, ...] = ()  # the policy samples no end-of-message token before the tool turn
    demo_call = '<tool_call>\n{{"name": "search", "arguments": {{"query": "{q}"}}}}\n</tool_call>'

    def __init__(self, max_queries: int = 3):
        self.max_queries = max_queries
        self.tools: dict[str, Any] | None = None  # the run's tools by name (ToolCallProtocol.bind_tools); None: search

    def example_call(self, query: str = "...") -> str:
        return f"{CALL_OPEN}\n" + json.dumps({"name": "search", "arguments": {"query": query}}) + f"\n{CALL_CLOSE}"

    def declaration(self, tools: list[dict[str, Any]]) -> str:
        """The tools as prompt text (base prompts; templates that ignore `tools`)."""
        signatures = "\n".join(json.dumps(t) for t in tools)
        return (
            "# Tools\n\nYou may call the functions below. Their signatures are inside <tools></tools>:\n"
            f"<tools>\n{signatures}\n</tools>\n\nTo call a function, write a JSON object with its name and arguments "
            'inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>"
        )

    def parse(self, text: str) -> Action | None:
        """`text`: the turn with its reasoning removed, right-stripped. A call is what ends at `</tool_call>`."""
        inner = _call_body(text)
        if inner is None or isinstance(inner, Action):
            return inner
        return _call_action(inner.strip(), "arguments", self.max_queries, self.tools)


class Llama3JsonFormat:
    name = "llama3_json"
    # `<|eom_id|>` is a stop string (both engines match stop strings on text decoded with special tokens); `<|eot_id|>`
    # is the tokenizer's EOS, so a call may also end the turn with EOS (eos_ends_call)
    stop_strings = ["<|eom_id|>", ANSWER_CLOSE]
    eos_ends_call = True
    sampled_turn_ends = ("<|eom_id|>", "<|eot_id|>")  # the template closes an assistant turn with <|eot_id|>
    demo_call = '{{"name": "search", "parameters": {{"query": "{q}"}}}}<|eom_id|>'

    def __init__(self, max_queries: int = 3):
        self.max_queries = max_queries
        self.tools: dict[str, Any] | None = None  # the run's tools by name (ToolCallProtocol.bind_tools); None: search

    def example_call(self, query: str = "...") -> str:
        return json.dumps({"name": "search", "parameters": {"query": query}})

    def declaration(self, tools: list[dict[str, Any]]) -> str:
        signatures = "\n\n".join(json.dumps(t) for t in tools)
        return (
            'To call a function, reply with one JSON object only: {"name": function name, "parameters": an object of '
            f"its arguments}}. The functions:\n\n{signatures}"
        )

    def parse(self, text: str) -> Action | None:
        """`text`: the turn with its reasoning removed, right-stripped. A call is a JSON object: the turn's text from
        its first `{` on. The rollout hides special tokens from the turn's text; a text that still has them (a
        demonstration, a dumped response) is read without `<|python_tag|>` and the closing end token."""
        text = text.replace(PYTHON_TAG, "")
        end = next((e for e in self.sampled_turn_ends if text.endswith(e)), None)
        text = text[: -len(end)].rstrip() if end else text
        start = text.find("{")
        if start < 0:
            return None
        if THINK_OPEN in text[:start]:
            return Action(kind="invalid", error="the tool call is inside <think>; calls go after </think>")
        return _call_action(text[start:], "parameters", self.max_queries, self.tools)


_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*)</function>\s*", flags=re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", flags=re.DOTALL)


class Qwen3XmlFormat:
    name = "qwen3_xml"
    stop_strings = [CALL_CLOSE, ANSWER_CLOSE]
    eos_ends_call = False  # as Hermes: a call ends at `</tool_call>`, the template closes the turn
    sampled_turn_ends: tuple[str, ...] = ()
    demo_call = "<tool_call>\n<function=search>\n<parameter=query>\n{q}\n</parameter>\n</function>\n</tool_call>"

    def __init__(self, max_queries: int = 3):
        self.max_queries = max_queries
        self.tools: dict[str, Any] | None = None  # the run's tools by name (ToolCallProtocol.bind_tools); None: search

    def example_call(self, query: str = "...") -> str:
        return self.demo_call.format(q=query)

    def declaration(self, tools: list[dict[str, Any]]) -> str:
        signatures = "\n".join(json.dumps(t) for t in tools)
        return (
            "# Tools\n\nYou have access to the functions below. Their signatures are inside <tools></tools>:\n"
            f"<tools>\n{signatures}\n</tools>\n\nTo call a function, reply in this form only:\n<tool_call>\n"
            "<function=example_function_name>\n<parameter=example_parameter>\nvalue\n</parameter>\n</function>\n"
            "</tool_call>"
        )

    def parse(self, text: str) -> Action | None:
        """`text`: the turn with its reasoning removed, right-stripped. A call is what ends at `</tool_call>`."""
        inner = _call_body(text)
        if inner is None or isinstance(inner, Action):
            return inner
        function = _FUNCTION.fullmatch(inner)
        if function is None:
            return Action(kind="invalid", error="the tool call must be <function=NAME> ... </function>")
        name, inner = function.group(1).strip(), function.group(2)
        if name != "search" and not (self.tools and name in self.tools):
            return unknown_tool(name, self.tools)
        params = {m.group(1).strip(): m.group(2).strip() for m in _PARAMETER.finditer(inner)}
        if _PARAMETER.sub("", inner).strip():
            return Action(kind="invalid", error="text between the parameters; write each as <parameter=NAME>")
        if name != "search":  # another tool of the run: its parameters typed by its schema, then checked
            args = typed_parameters(params, self.tools[name].parameters)
            return tool_action({"name": name, "parameter": args}, "parameter", self.tools)
        if "query" not in params:
            return Action(kind="invalid", error="the search tool needs <parameter=query>")
        query: Any = params["query"]
        if query.startswith("["):  # several queries as a JSON list of strings
            try:
                query = json.loads(query)
            except (ValueError, RecursionError):
                return Action(kind="invalid", error="<parameter=query> starts with '[' but is not a JSON list")
        return search_action({"query": query}, self.max_queries, "parameter")


CALL_FORMATS = {"hermes": HermesFormat, "llama3_json": Llama3JsonFormat, "qwen3_xml": Qwen3XmlFormat}
# model.family -> its call format (hermes for the others: Qwen2 / Qwen2.5 / Qwen3, SmolLM2)
FAMILY_FORMATS = {"llama3": "llama3_json", "qwen3_5": "qwen3_xml", "qwen3_5_moe": "qwen3_xml"}
QWEN3_5_THINK_ID = 248068  # `<think>` in Qwen3.5 / 3.6's vocabulary (151667 in Qwen3's)


def call_format(name: str, max_queries: int = 3) -> HermesFormat | Llama3JsonFormat | Qwen3XmlFormat:
    if name not in CALL_FORMATS:
        raise ValueError(f"tool_call: call_format {name!r} is not one of {['auto', *CALL_FORMATS]}")
    return CALL_FORMATS[name](max_queries)


def call_format_for(tokenizer) -> str:
    """The call format of a tokenizer's family: llama3_json when it has Llama 3's header and tool tokens, qwen3_xml
    for Qwen3.5 / 3.6's vocabulary (`<think>` at its id there), else hermes."""
    vocab = tokenizer.get_vocab()
    if all(t in vocab for t in LLAMA3_MARKERS):
        return "llama3_json"
    return "qwen3_xml" if vocab.get(THINK_OPEN) == QWEN3_5_THINK_ID else "hermes"
