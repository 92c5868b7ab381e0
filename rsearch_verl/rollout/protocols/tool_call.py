"""JSON tool calls through the chat template (the Qwen2.5 / Qwen3 / Hermes style): the search tool is declared in
the chat template's `tools`; the policy writes `<tool_call>{"name": "search", "arguments": {"query": "..."}}
</tool_call>`; results come back inside `<tool_response>…</tool_response>`, framed the way the model's own template
frames a tool turn; the final answer is `<answer>…</answer>` (Search-R1's EM reward reads it).

    proto = get_protocol("tool_call")                 # kwargs: enable_thinking (Qwen3 templates), max_queries,
                                                      # call_format (hermes | llama3_json | qwen3_xml | auto)
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

How the call itself is written is the call format's (rsearch_verl/rollout/protocols/call_formats.py): the Hermes
`<tool_call>` above, or Llama 3's bare JSON `{"name": "search", "parameters": {...}}` ended by the model's own
`<|eom_id|>` / `<|eot_id|>` and answered in an `ipython` turn (the observation then starts after that end token), or
Qwen3.5 / 3.6's XML `<tool_call><function=search><parameter=query>...` (answered as Hermes calls are).
`protocol_for(cfg)` picks it from `model.family`; `call_format=auto` from the bound tokenizer.

Parsing never raises: malformed JSON, an unknown tool, missing or empty arguments, a call without its opening tag
or a call inside an unclosed `<think>` (reasoning; Qwen3's parsers do not execute calls there) become an "invalid"
action whose observation says what was wrong and shows the expected form. Reasoning is handled as the templates do:
complete `<think>…</think>` blocks are not searched for calls or answers, and a response that starts inside a
`<think>` opened by the generation prompt is read from its first `</think>`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from rsearch_verl.formats import extract_tag
from rsearch_verl.rollout.protocols.base import Action, SearchProtocol
from rsearch_verl.rollout.protocols.call_formats import CALL_FORMATS, HermesFormat, call_format, call_format_for
from rsearch_verl.rollout.protocols.tagged import TagSearchProtocol
from rsearch_verl.rollout.tools import Tool
from rsearch_verl.rollout.tools.search import SearchTool

logger = logging.getLogger(__name__)

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
INLINE_FRAME = (f"\n{RESPONSE_OPEN}\n", f"\n{RESPONSE_CLOSE}\n")  # no chat template: the response sits in the text

SEARCH_TOOL: dict[str, Any] = SearchTool().declaration()  # the default run's one declaration

TOOL_CALL_INSTRUCTIONS = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call the search tool, and it "
    "will return the top searched results between <tool_response> and </tool_response>. You can search as many "
    "times as you want. If you find no further external knowledge needed, you can directly provide the answer "
    "inside <answer> and </answer> without detailed illustrations. For example, <answer> Beijing </answer>."
)


def example_call(query: str = "...") -> str:
    """A Hermes-style call (the default format's)."""
    return HermesFormat().example_call(query)


def tool_declaration(tools: list[dict[str, Any]]) -> str:
    """The tools as system-prompt text (Hermes style), for prompts whose chat template ignores `tools`."""
    return HermesFormat().declaration(tools)


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
    assistant message to the next generation prompt; None when the template does not render a tool turn. (The
    protocol's observation frame adds what the template lacks: `ToolCallProtocol._observation_frame`.)"""
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
    return before, after


class ToolCallProtocol(TagSearchProtocol):
    """Search as a JSON tool call; GRPO recipe `search_r1_toolcall_grpo` (EM reward on `<answer>`).

    `call_format`: how the call is written (rsearch_verl/rollout/protocols/call_formats.py): hermes | llama3_json |
    qwen3_xml | auto (the bound tokenizer's family: Llama 3's tokens -> llama3_json, Qwen3.5's vocabulary ->
    qwen3_xml, else hermes; hermes until one is bound).
    `protocol_for(cfg)` resolves auto from `model.family` before any prompt is built."""

    name = "tool_call"
    # the class's are the Hermes format's; an instance's are its format's (set in __init__ / bind_tokenizer)
    stop_strings = HermesFormat.stop_strings
    # (think, call, answer) of a demonstration turn (rsearch_verl/toy/demos.py)
    demo_format = ("<think> {t} </think>\n", HermesFormat.demo_call, "<answer> {a} </answer>")
    observation_open = RESPONSE_OPEN
    observation_close = RESPONSE_CLOSE
    system_prompt = TOOL_CALL_INSTRUCTIONS

    def __init__(self, enable_thinking: bool | None = None, max_queries: int = 3, call_format: str = "auto"):
        if max_queries < 1:
            raise ValueError(f"tool_call: max_queries must be >= 1, got {max_queries}")
        if call_format != "auto" and call_format not in CALL_FORMATS:
            raise ValueError(f"tool_call: call_format {call_format!r} is not one of {['auto', *CALL_FORMATS]}")
        self.tools = [SEARCH_TOOL]
        # Qwen3's template reads `enable_thinking`; other templates ignore unknown variables
        self.chat_template_kwargs = {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}
        self.max_queries = max_queries
        self.call_format = call_format
        self.format = self._format_named("hermes" if call_format == "auto" else call_format)
        self.frame = INLINE_FRAME
        self.template_frame: tuple[str, str] | None = None  # the template's own text around a tool message's content
        self._bound: tuple[int, bool] | None = None

    def _format_named(self, name: str):
        fmt = call_format(name, self.max_queries)
        fmt.tools = self.run_tools
        self.stop_strings = list(fmt.stop_strings)
        self.eos_ends_call = fmt.eos_ends_call
        self.demo_format = ("<think> {t} </think>\n", fmt.demo_call, "<answer> {a} </answer>")
        return fmt

    # ---- tools ------------------------------------------------------------------------------------------------
    def bind_tools(self, tools: Sequence[Tool]) -> None:
        """Every tool of the run is declared to the chat template (`tools`) and callable by name; the stop strings
        stay the call format's (a call of any tool ends the same way)."""
        SearchProtocol.bind_tools(self, tools)
        self.tools = [t.declaration() for t in self.run_tools.values()]
        self.format.tools = self.run_tools
        self.tools_text = " ".join(f"You can also call the {t.name} tool: {t.description}" for t in self.extra_tools())
        self._bound = None  # the observation frame is rendered with the declarations: render it again

    # ---- prompts ----------------------------------------------------------------------------------------------
    def base_prompt(self, question: str) -> str:
        return f"{self.instructions()}\n\n{self.format.declaration(self.tools)}\n\nQuestion: {question}\n"

    def bind_tokenizer(self, tokenizer: Any, chat: bool) -> None:
        key = (id(tokenizer), bool(chat))
        if key == self._bound:
            return
        if self.call_format == "auto":
            self.format = self._format_named(call_format_for(tokenizer))
        frame = chat_tool_frame(tokenizer, self.tools, self.chat_template_kwargs) if chat else None
        self.template_frame = frame
        self.frame = self._observation_frame(frame) if frame else INLINE_FRAME
        self._bound = key

    def _observation_frame(self, frame: tuple[str, str]) -> tuple[str, str]:
        """The observation's text around a result: the template's frame, with `<tool_response>` tags added when the
        template has none, and without the end-of-message token a format's policy samples itself (Llama 3)."""
        before, after = frame
        if RESPONSE_OPEN not in before:  # a plain `tool` / `ipython` turn (SmolLM2, Llama 3): tags around the content
            before, after = f"{before}{RESPONSE_OPEN}\n", f"\n{RESPONSE_CLOSE}{after}"
        end = next((e for e in self.format.sampled_turn_ends if before.startswith(e)), None)
        return (before[len(end) :] if end else before), after

    def tool_content(self, observation: str) -> str | None:
        """The `tool` message content the chat template frames as `observation` (the round-trip check re-renders
        it: rsearch_verl/rollout/round_trip.py), or None when `observation` is not framed the template's way."""
        if self.template_frame is None:
            return None
        before, after = self._observation_frame(self.template_frame)
        if not (observation.startswith(before) and observation.endswith(after)):
            return None
        content = observation[len(before) : len(observation) - len(after)]
        if RESPONSE_OPEN not in self.template_frame[0]:
            content = f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
        return content

    # ---- parsing ----------------------------------------------------------------------------------------------
    def parse_turn(self, turn_text: str) -> Action:
        text = reasoning_removed(turn_text).rstrip()
        if not text.endswith("</answer>"):
            call = self.format.parse(text)
            if call is not None:
                return call
        answer = self.answer_in(text)
        return Action(kind="answer", answer=answer) if answer is not None else Action(kind="none")

    # ---- observations -----------------------------------------------------------------------------------------
    def wrap(self, body: str) -> str:
        before, after = self.frame
        return f"{before}{body}{after}"

    def invalid_text(self, action: Action) -> str:
        return (
            f"Invalid tool call ({action.error}). To search, write {self.format.example_call()}; to finish, write "
            "<answer> answer </answer>."
        )

    # ---- answers ----------------------------------------------------------------------------------------------
    def answer_in(self, policy: str) -> str | None:
        """The last complete `<answer>` block outside the reasoning (`reasoning_removed`)."""
        return extract_tag(reasoning_removed(policy), self.answer_tag)
