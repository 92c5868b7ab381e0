"""The tag protocols' shared machinery: the policy closes a query tag, the environment answers inside observation tags
and the answer sits in `<answer>`. Search-R1, ReSearch, R1-Searcher, R-Search, the NL-DAG and the JSON tool-call
protocol subclass `TagSearchProtocol` and change only their tags, templates, parsing of a query and document format.

    class MyProtocol(TagSearchProtocol):
        name = "my_protocol"                                  # + one line in protocols/__init__.py's registry
        stop_strings = ["</search>", "</answer>"]
        observation_open, observation_close = "<information>", "</information>"
        system_prompt = "..."                                 # the paper's instructions (see `build_prompt`)
        demo_format = ("<think> {t} </think>\n", "<search> {q} </search>", "<answer> {a} </answer>")
"""

from __future__ import annotations

from rsearch_verl.choices import PROMPT_VARIANTS
from rsearch_verl.formats import extract_tag
from rsearch_verl.rollout.protocols.base import Action, SearchProtocol
from rsearch_verl.search.client import SearchError
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

    # ---- prompts ----------------------------------------------------------------------------------------------
    def build_prompt(self, question: str, variant: str = "base") -> str | list[dict[str, str]]:
        if variant not in PROMPT_VARIANTS:
            raise ValueError(f"prompt variant must be one of {list(PROMPT_VARIANTS)}, got {variant!r}")
        question = question.strip()
        return self.base_prompt(question) if variant == "base" else self.chat_prompt(question)

    def base_prompt(self, question: str) -> str:
        """The base-model prompt for a stripped question: the instructions, then the question."""
        return f"{self.system_prompt}\n\nQuestion: {question}\n"

    def chat_prompt(self, question: str) -> list[dict[str, str]]:
        """The instruct variant: the instructions as the system message, the question as the user's."""
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]

    # ---- parsing ----------------------------------------------------------------------------------------------
    def parse_turn(self, turn_text: str) -> Action:
        text = turn_text.rstrip()
        if text.endswith(self.query_close):
            return self._parse_query(text[: -len(self.query_close)])
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

    # ---- observations -----------------------------------------------------------------------------------------
    def wrap(self, body: str) -> str:
        return f"{self.obs_prefix}{self.observation_open}{body}{self.observation_close}{self.obs_suffix}"

    def invalid_text(self, action: Action) -> str:
        return (
            f"Invalid search ({action.error}). To search, write {self.query_open} query {self.query_close}; "
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

    async def observe(self, action: Action, search: SearchFn, topk: int) -> str:
        if action.kind == "invalid":
            return self.wrap(self.invalid_text(action))
        if action.kind != "search" or not action.queries:
            raise ValueError(f"observe() needs a search or invalid action, got {action.kind!r}")
        try:
            results = await search(action.queries, topk, self.source)
        except SearchError as exc:
            return self.wrap(f"search failed: {exc.short()}")
        docs = [d for per_query in results for d in per_query]
        return self.wrap(self.format_docs(docs) if docs else self.empty_results)

    # ---- answers ----------------------------------------------------------------------------------------------
    def answer_in(self, policy: str) -> str | None:
        """The content of the last complete `<answer>` block of the policy text."""
        return extract_tag(policy, self.answer_tag)
