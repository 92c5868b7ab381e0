"""The interface of a search protocol: how a paper's policy asks for search and how results come back.

A protocol owns its prompt templates (base and instruct variants), the stop strings that pause generation,
the parser of one turn, how an action is executed against the search backend, and the observation format.
One protocol per file in this package; `get_protocol(name)` (in `__init__.py`) picks one by its YAML name.

The agent loop uses it like this:

    proto = get_protocol("search_r1")
    prompt = proto.build_prompt(question, variant="base")            # str, or chat messages for "instruct"
    out = await engine.generate(ids, sampling, stop=proto.stop_strings)
    action = proto.parse_turn(turn_text)                              # search / answer / none
    if action.kind == "search":
        obs_text = await proto.observe(action, search)                # inserted with response_mask 0
    answer = proto.extract_answer(segments)   # THE answer extractor: rewards, evaluation, the viewer
                                              # (parse_turn applies the same rule, `answer_in`, to one turn)

`segments` is the trajectory's `[(role, text)]` record (rsearch_verl/segments.py): the answer is read from
policy text only, i.e. the policy segments; a block the policy forged itself (an `<information>` it typed) is policy
text, an answer inside an observation the environment inserted never is. A plain string is a response without a
recorded mask, split at the protocol's observation tags by `segments_from_text` (see there for what that loses).

The run's tools (`rollout.tools`: rsearch_verl/rollout/tools/) reach a protocol through `proto.bind_tools(tools)`
(`protocol_for(cfg)` calls it; unbound, a protocol has the `search` tool only): a tag protocol then also stops at
`</name>` of each tool besides search and parses `<name> … </name>`, the tool-call protocol declares every tool;
either way a call of such a tool is `Action(kind="tool", tool=name, args={...})`, run by `observe`.

Tool-call protocols also declare `tools` (JSON schemas handed to the chat template's `tools` argument) and may
depend on the model's chat template for their observation text: the agent loop calls
`proto.bind_tokenizer(tokenizer, chat)` before a batch (a no-op for the tag protocols).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rsearch_verl.rollout.tools import Tool, build_tools
from rsearch_verl.search.types import SearchFn
from rsearch_verl.segments import Segment, policy_text, segments_from_text


@dataclass
class Action:
    # "search" | "tool" (a tool of rollout.tools other than search) | "answer" | "none" (no tag: the trajectory ends)
    # | "invalid" (a malformed call: its observation says what was wrong)
    kind: str
    queries: list[str] = field(default_factory=list)
    answer: str | None = None
    plan: Any = None  # protocol-specific parsed structure (e.g. the NL-DAG)
    error: str | None = None  # why the action is invalid; shown to the policy in the observation
    tool: str | None = None  # kind "tool": the tool's name
    args: dict[str, Any] = field(default_factory=dict)  # kind "tool": its arguments, checked against its schema


class SearchProtocol(ABC):
    name: str = ""
    stop_strings: list[str] = []  # generation pauses after any of these
    special_tokens: list[str] = []  # added to the tokenizer (R1-Searcher's <|begin_of_query|> …)
    observation_open: str = ""
    observation_close: str = ""
    tools: list[dict[str, Any]] = []  # tool declarations for the chat template's `tools` (tool-call protocols)
    chat_template_kwargs: dict[str, Any] = {}  # extra chat-template variables (e.g. Qwen3's enable_thinking)
    eos_ends_call: bool = False  # a turn that ends with EOS may still be a call (Llama 3's `<|eot_id|>` after JSON)

    @property
    def run_tools(self) -> dict[str, Tool]:
        """The run's tools by name (`bind_tools`; `search` alone until bound)."""
        if "_run_tools" not in self.__dict__:
            self._run_tools = {t.name: t for t in build_tools(["search"])}
        return self._run_tools

    def bind_tools(self, tools: Sequence[Tool]) -> None:
        """Make `tools` (rollout.tools, built by `build_tools`) the ones the policy can call. Idempotent."""
        self._run_tools = {t.name: t for t in tools}

    def bind_tokenizer(self, tokenizer: Any, chat: bool) -> None:  # noqa: B027 - optional hook
        """Adapt text that depends on the model's chat template; `chat`: the prompts went through that template.
        Idempotent; the tag protocols' text does not depend on it."""

    @abstractmethod
    def build_prompt(self, question: str, variant: str = "base") -> str | list[dict[str, str]]:
        """The paper's prompt for `question`: a string (base models) or chat messages (variant 'instruct')."""

    @abstractmethod
    def parse_turn(self, turn_text: str) -> Action:
        """Parse the text the policy generated in the latest turn (ends with a stop string, EOS or truncation)."""

    @abstractmethod
    async def observe(self, action: Action, search: SearchFn, topk: int) -> str:
        """Run a search action and return the observation text to insert (with the protocol's tags and the
        leading/trailing newlines the paper uses). Search failures become an explicit error observation inside the
        observation tags ("search failed: timeout"); an "invalid" action gets a short corrective observation."""

    def segments_of(self, response: str | Sequence[Segment]) -> list[Segment]:
        """`response` as segments: recorded segments as they are; a string (no mask recorded) split at this
        protocol's observation tags."""
        if isinstance(response, str):
            return segments_from_text(response, self.observation_open, self.observation_close)
        return list(response)

    def extract_answer(self, response: str | Sequence[Segment]) -> str | None:
        """The final answer of a whole response (segments, or a string without mask), or None: `answer_in` applied
        to its policy text. The one answer extractor of the code base (rewards, evaluation and the viewer call it)."""
        return self.answer_in(policy_text(self.segments_of(response)))

    @abstractmethod
    def answer_in(self, policy: str) -> str | None:
        """This protocol's answer rule applied to policy text (what the policy sampled; never the prompt, never an
        observation), or None when it holds no answer. Callers with a response use `extract_answer`."""
