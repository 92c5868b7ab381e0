"""JSON tool calls through the chat template (the Qwen2.5 / Qwen3 / Hermes style): the search tool is declared in
the chat template's `tools`; the policy writes `<tool_call>{"name": "search", "arguments": {"query": "..."}}
</tool_call>`; results come back inside `<tool_response>…</tool_response>`, framed the way the model's own template
frames a tool turn; the final answer is `<answer>…</answer>` (Search-R1's EM reward reads it).

    proto = get_protocol("tool_call")                 # kwargs: enable_thinking (Qwen3 templates), max_queries
    proto.build_prompt(q, "instruct")                 # [system, user] messages; `proto.tools` goes to the template
    render_prompt(messages, tokenizer, proto.tools)   # rsearch_verl.data.dataset: tools declared by the template,
                                                      # or in the system message when the template ignores them
    proto.bind_tokenizer(tokenizer, chat=True)        # observations framed as the template's tool turn
    proto.parse_turn('<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>')  # Action("search")

Observation framing. With a chat template (`chat=True`), an observation is what the template writes between the
end of an assistant message and the next generation prompt when a `tool` message follows: for Qwen2.5/3
`<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n…\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n` (plus
Qwen3's empty `<think>` block when thinking is off). It is computed once per tokenizer by rendering a probe
conversation, so it follows whatever template the model ships; a template without tool-response tags (SmolLM2's
renders a plain `tool` turn) gets `<tool_response>` tags around the content. Without a chat template (base prompts)
the observation is inline: `\\n<tool_response>\\n…\\n</tool_response>\\n`. Either way every observation token is
inserted by the environment (response_mask 0); a `<tool_response>` the policy writes itself is sampled text (mask 1).

Parsing never raises: malformed JSON, an unknown tool, missing or empty arguments, a call without its opening tag
or a call inside an unclosed `<think>` (reasoning; Qwen3's parsers do not execute calls there) become an "invalid"
action whose observation says what was wrong and shows the expected form. Reasoning is handled as the templates do:
complete `<think>…</think>` blocks are not searched for calls or answers, and a response that starts inside a
`<think>` opened by the generation prompt is read from its first `</think>`.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from rsearch_verl.formats import extract_tag
from rsearch_verl.rollout.protocols.base import Action
from rsearch_verl.rollout.protocols.tagged import MAX_QUERY_CHARS, TagSearchProtocol

logger = logging.getLogger(__name__)

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
INLINE_FRAME = (f"\n{RESPONSE_OPEN}\n", f"\n{RESPONSE_CLOSE}\n")  # no chat template: the response sits in the text

SEARCH_TOOL: dict[str, Any] = {
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

TOOL_CALL_INSTRUCTIONS = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call the search tool, and it "
    "will return the top searched results between <tool_response> and </tool_response>. You can search as many "
    "times as you want. If you find no further external knowledge needed, you can directly provide the answer "
    "inside <answer> and </answer> without detailed illustrations. For example, <answer> Beijing </answer>."
)


def example_call(query: str = "...") -> str:
    return f"{CALL_OPEN}\n" + json.dumps({"name": "search", "arguments": {"query": query}}) + f"\n{CALL_CLOSE}"


def tool_declaration(tools: list[dict[str, Any]]) -> str:
    """The tools as system-prompt text, for prompts whose chat template ignores `tools` and for base prompts."""
    signatures = "\n".join(json.dumps(t) for t in tools)
    return (
        "# Tools\n\nYou may call the functions below. Their signatures are inside <tools></tools>:\n"
        f"<tools>\n{signatures}\n</tools>\n\nTo call a function, write a JSON object with its name and arguments "
        'inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )


def declare_tools(messages: list[dict[str, str]], tools: list[dict[str, Any]]) -> list[dict[str, str]]:
    """`messages` with the tool declaration appended to the system message (one is added when there is none)."""
    out = [dict(m) for m in messages]
    text = tool_declaration(tools)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{text}"
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


_THINK_BLOCK = re.compile(re.escape(THINK_OPEN) + r".*?" + re.escape(THINK_CLOSE), flags=re.DOTALL)


def reasoning_removed(text: str) -> str:
    """`text` without its reasoning: complete <think> blocks cut, and everything up to a leading `</think>` that
    closes a block the generation prompt opened (Qwen3 thinking templates end the prompt with `<think>`)."""
    close = text.find(THINK_CLOSE)
    if close >= 0 and not 0 <= text.find(THINK_OPEN) < close:
        text = text[close + len(THINK_CLOSE) :]
    return _THINK_BLOCK.sub(" ", text)


def chat_tool_frame(tokenizer, tools: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """(before, after): the text the chat template writes around a tool message's content, from the end of an
    assistant message to the next generation prompt; None when the template does not render a tool turn."""
    call, content = "\u2063CALL\u2063", "\u2063CONTENT\u2063"  # invisible separators: never in a real template
    messages = [
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": content},
    ]
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **template_kwargs
        )
    except Exception as exc:  # noqa: BLE001 - a template may reject the tool role: fall back to inline frames
        logger.warning("chat template cannot render a tool turn (%s); tool responses go inline", exc)
        return None
    if text.count(call) != 1 or text.count(content) != 1 or text.index(call) > text.index(content):
        return None
    before, after = text.split(call, 1)[1].split(content, 1)
    if RESPONSE_OPEN not in before:  # a plain `tool` turn (SmolLM2): the content gets the tags itself
        before, after = f"{before}{RESPONSE_OPEN}\n", f"\n{RESPONSE_CLOSE}{after}"
    return before, after


class ToolCallProtocol(TagSearchProtocol):
    """Search as a JSON tool call; GRPO recipe `search_r1_toolcall_grpo` (EM reward on `<answer>`)."""

    name = "tool_call"
    stop_strings = [CALL_CLOSE, "</answer>"]
    observation_open = RESPONSE_OPEN
    observation_close = RESPONSE_CLOSE
    system_prompt = TOOL_CALL_INSTRUCTIONS
    demo_format = (
        "<think> {t} </think>\n",
        '<tool_call>\n{{"name": "search", "arguments": {{"query": "{q}"}}}}\n</tool_call>',
        "<answer> {a} </answer>",
    )

    def __init__(self, enable_thinking: bool | None = None, max_queries: int = 3):
        if max_queries < 1:
            raise ValueError(f"tool_call: max_queries must be >= 1, got {max_queries}")
        self.tools = [SEARCH_TOOL]
        # Qwen3's template reads `enable_thinking`; other templates ignore unknown variables
        self.chat_template_kwargs = {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}
        self.max_queries = max_queries
        self.frame = INLINE_FRAME
        self._bound: tuple[int, bool] | None = None

    # ---- prompts ----------------------------------------------------------------------------------------------
    def base_prompt(self, question: str) -> str:
        return f"{self.system_prompt}\n\n{tool_declaration(self.tools)}\n\nQuestion: {question}\n"

    def bind_tokenizer(self, tokenizer: Any, chat: bool) -> None:
        key = (id(tokenizer), bool(chat))
        if key == self._bound:
            return
        frame = chat_tool_frame(tokenizer, self.tools, self.chat_template_kwargs) if chat else None
        self.frame = frame or INLINE_FRAME
        self._bound = key

    # ---- parsing ----------------------------------------------------------------------------------------------
    def parse_turn(self, turn_text: str) -> Action:
        text = reasoning_removed(turn_text).rstrip()
        if text.endswith(CALL_CLOSE):
            return self._parse_call(text[: -len(CALL_CLOSE)])
        answer = self.answer_in(text)
        return Action(kind="answer", answer=answer) if answer is not None else Action(kind="none")

    def _parse_call(self, body: str) -> Action:
        start = body.rfind(CALL_OPEN)
        if start < 0:
            return Action(kind="invalid", error=f"{CALL_CLOSE} without {CALL_OPEN}")
        if THINK_OPEN in body[:start]:  # unclosed <think> before the call: still reasoning
            return Action(kind="invalid", error="the tool call is inside <think>; calls go after </think>")
        raw = body[start + len(CALL_OPEN) :].strip()
        try:
            call = json.loads(raw)
        except json.JSONDecodeError as exc:
            return Action(kind="invalid", error=f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})")
        except (ValueError, RecursionError):  # a number too long to convert, nesting too deep
            return Action(kind="invalid", error="the tool call is not a JSON object this parser accepts")
        if not isinstance(call, dict):
            return Action(kind="invalid", error='the tool call must be a JSON object {"name": …, "arguments": …}')
        if call.get("name") != "search":
            return Action(kind="invalid", error=f"unknown tool {call.get('name')!r}; the only tool is 'search'")
        return self._search_action(call.get("arguments"))

    def _search_action(self, args: Any) -> Action:
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return Action(kind="invalid", error="'arguments' is a string that is not a JSON object")
        if not isinstance(args, dict) or "query" not in args:
            return Action(kind="invalid", error='the search tool needs "arguments": {"query": "..."}')
        query = args["query"]
        queries = query if isinstance(query, list) else [query]
        if not queries or len(queries) > self.max_queries or not all(isinstance(q, str) for q in queries):
            return Action(kind="invalid", error=f"'query' must be a string (or a list of <= {self.max_queries})")
        queries = [" ".join(q.split())[:MAX_QUERY_CHARS] for q in queries]
        if not all(queries):
            return Action(kind="invalid", error="empty search query")
        return Action(kind="search", queries=queries)

    # ---- observations -----------------------------------------------------------------------------------------
    def wrap(self, body: str) -> str:
        before, after = self.frame
        return f"{before}{body}{after}"

    def invalid_text(self, action: Action) -> str:
        return (
            f"Invalid tool call ({action.error}). To search, write {example_call()}; to finish, write "
            "<answer> answer </answer>."
        )

    # ---- answers ----------------------------------------------------------------------------------------------
    def answer_in(self, policy: str) -> str | None:
        """The last complete `<answer>` block outside the reasoning (`reasoning_removed`)."""
        return extract_tag(reasoning_removed(policy), self.answer_tag)
