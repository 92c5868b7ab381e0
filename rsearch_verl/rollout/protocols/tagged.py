"""The tag protocols' shared machinery: the policy closes a query tag, the environment answers inside observation tags
and the answer sits in `<answer>`. Search-R1, ReSearch, R1-Searcher, R-Search, the NL-DAG and the JSON tool-call
protocol subclass `TagSearchProtocol` and change only their tags, templates, parsing of a query and document format.

    class MyProtocol(TagSearchProtocol):
        name = "my_protocol"                                  # + one line in protocols/__init__.py's registry
        stop_strings = ["</search>", "</answer>"]
        observation_open, observation_close = "<information>", "</information>"
        system_prompt = "..."                                 # the paper's instructions (see `build_prompt`)
        demo_format = ("<think> {t} </think>\n", "<search> {q} </search>", "<answer> {a} </answer>")

Tools besides search (`rollout.tools`, bound by `bind_tools`) are written `<name> body </name>`: `<open> doc-id [page]
</open>` for `open` (the tag is the tool's name, so one name serves the YAML, the tag, a tool call and the metrics).
Only then does generation also stop at `</name>` and do the instructions gain one sentence per tool; with the default
tools (`[search]`) prompts, stop strings and observations are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from rsearch_verl.choices import PROMPT_VARIANTS
from rsearch_verl.formats import extract_tag
from rsearch_verl.rollout.protocols.base import Action, SearchProtocol
from rsearch_verl.rollout.tools import Tool, ToolContext
from rsearch_verl.search.types import Doc, SearchFn

MAX_QUERY_CHARS = 512  # a runaway "query" is cut, not sent whole to the retriever


class TagSearchProtocol(SearchProtocol):
    """One query per turn between `query_open`/`query_close`; observation between the observation tags."""

    query_open = "<search>"
    query_close = "</search>"
    answer_tag = "answer"
    obs_prefix = "\n\n"  # text around the observation block, as the paper's rollouts show it
    obs_suffix = "\n\n"
    source = "local"  # the SearchFn source these protocols query
    empty_results = "No results found."
    system_prompt = ""  # the paper's instructions: the system message (instruct), the text before the question (base)
    # how the policy writes (thought, search call, final answer) in this protocol's demonstrations (SFT warm start,
    # rsearch_verl/toy/demos.py, which checks each rendered demonstration with this protocol's own parser);
    # {t}, {q}, {a}: the thought, the query, the answer
    demo_format: tuple[str, str, str] = ("<think> {t} </think>\n", "<search> {q} </search>", "<answer> {a} </answer>")
    demo_evidence = ""  # text the policy writes before its answer in a demonstration; {e}: the supporting passages
    tools_text = ""  # the instructions' sentences on the tools besides search (bind_tools)

    # ---- tools ------------------------------------------------------------------------------------------------
    def bind_tools(self, tools: Sequence[Tool]) -> None:
        super().bind_tools(tools)
        extra = self.extra_tools()
        self.stop_strings = [*type(self).stop_strings, *(f"</{t.name}>" for t in extra)]
        self.tools_text = " ".join(
            f"You can also use the {t.name} tool: {t.description} Write <{t.name}> {t.syntax()} </{t.name}>; its "
            f"result comes back between {self.observation_open} and {self.observation_close}."
            for t in extra
        )

    def extra_tools(self) -> list[Tool]:
        """The run's tools besides search (those written `<name> … </name>`)."""
        return [t for name, t in self.run_tools.items() if name != "search"]

    def instructions(self) -> str:
        """The system prompt, with the sentences on the run's other tools (none by default)."""
        return f"{self.system_prompt} {self.tools_text}" if self.tools_text else self.system_prompt

    # ---- prompts ----------------------------------------------------------------------------------------------
    def build_prompt(self, question: str, variant: str = "base") -> str | list[dict[str, str]]:
        if variant not in PROMPT_VARIANTS:
            raise ValueError(f"prompt variant must be one of {list(PROMPT_VARIANTS)}, got {variant!r}")
        question = question.strip()
        return self.base_prompt(question) if variant == "base" else self.chat_prompt(question)

    def base_prompt(self, question: str) -> str:
        """The base-model prompt for a stripped question: the instructions, then the question."""
        return f"{self.instructions()}\n\nQuestion: {question}\n"

    def chat_prompt(self, question: str) -> list[dict[str, str]]:
        """The instruct variant: the instructions as the system message, the question as the user's."""
        return [{"role": "system", "content": self.instructions()}, {"role": "user", "content": question}]

    # ---- parsing ----------------------------------------------------------------------------------------------
    def parse_turn(self, turn_text: str) -> Action:
        text = turn_text.rstrip()
        if text.endswith(self.query_close):
            return self._parse_query(text[: -len(self.query_close)])
        tool = next((t for t in self.extra_tools() if text.endswith(f"</{t.name}>")), None)
        if tool is not None:
            return self._parse_tool(tool, text[: -len(f"</{tool.name}>")])
        if f"</{self.answer_tag}>" in text and f"<{self.answer_tag}>" in text:
            return Action(kind="answer", answer=self.answer_in(text))  # a turn is all policy text
        return Action(kind="none")

    def _parse_query(self, body: str) -> Action:
        start = body.rfind(self.query_open)
        if start < 0:
            return Action(kind="invalid", error=f"{self.query_close} without {self.query_open}")
        query = " ".join(body[start + len(self.query_open) :].split())
        if not query:
            return Action(kind="invalid", error="empty search query")
        return Action(kind="search", queries=[query[:MAX_QUERY_CHARS]])

    def _parse_tool(self, tool: Tool, body: str) -> Action:
        start = body.rfind(f"<{tool.name}>")
        if start < 0:
            return Action(kind="invalid", error=f"</{tool.name}> without <{tool.name}>", tool=tool.name)
        args = tool.tag_arguments(body[start + len(tool.name) + 2 :])
        error = args if isinstance(args, str) else tool.check_arguments(args)
        if error:
            return Action(kind="invalid", error=error, tool=tool.name)
        return Action(kind="tool", tool=tool.name, args=args)

    # ---- observations -----------------------------------------------------------------------------------------
    def wrap(self, body: str) -> str:
        return f"{self.obs_prefix}{self.observation_open}{body}{self.observation_close}{self.obs_suffix}"

    def invalid_text(self, action: Action) -> str:
        what = f"{action.tool} call" if action.tool else "search"
        others = "".join(f"; to use {t.name}, write <{t.name}> {t.syntax()} </{t.name}>" for t in self.extra_tools())
        return (
            f"Invalid {what} ({action.error}). To search, write {self.query_open} query {self.query_close}{others}; "
            f"to finish, write <{self.answer_tag}> answer </{self.answer_tag}>."
        )

    def format_docs(self, docs: list[Doc]) -> str:
        """Search-R1's passage text, byte for byte as its released rollout writes it: per passage
        'Doc i(Title: <first line of contents, as is>) <the other lines>' and a newline, the whole stripped. With the
        Wikipedia corpus's '"Title"\\ntext' contents the title keeps its quotes: 'Doc 1(Title: "Hamlet") text'."""
        text = ""
        for i, d in enumerate(docs, 1):
            title, _, body = d.contents.partition("\n")
            text += f"Doc {i}(Title: {title}) {body}\n"
        return text.strip()

    def tool_context(self, search: SearchFn, topk: int) -> ToolContext:
        """What the run's tools run with for one call (the trajectory's search handle)."""
        show_ids = any(t.takes_doc_ids for t in self.run_tools.values())
        return ToolContext(search=search, topk=topk, protocol=self, show_doc_ids=show_ids)

    async def observe(self, action: Action, search: SearchFn, topk: int) -> str:
        """Invalid: the corrective text; search / tool: the run's tool of that name, its body in the observation
        tags (a failure, e.g. "search failed: timeout", is a body too)."""
        if action.kind == "invalid":
            return self.wrap(self.invalid_text(action))
        if action.kind == "search" and action.queries:
            name, args = "search", {"query": action.queries}
        elif action.kind == "tool" and action.tool in self.run_tools:
            name, args = action.tool, action.args
        else:
            raise ValueError(f"observe() needs a search, tool or invalid action, got {action.kind!r} {action.tool!r}")
        return self.wrap(await self.run_tools[name].observe(args, self.tool_context(search, topk)))

    # ---- answers ----------------------------------------------------------------------------------------------
    def answer_in(self, policy: str) -> str | None:
        """The content of the last complete `<answer>` block of the policy text."""
        return extract_tag(policy, self.answer_tag)
