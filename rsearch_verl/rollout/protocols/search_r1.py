"""Search-R1 (Jin et al. 2025): `<think>`, `<search> q </search>`, `<information>…</information>`, `<answer>`.

Also home of `TagSearchProtocol`, the shared machinery of every protocol where the policy closes a query tag,
the environment answers inside observation tags and the answer sits in `<answer>` (ReSearch, R1-Searcher and
R-Search subclass it and change only tags, templates and the document format).

    proto = SearchR1Protocol()
    proto.build_prompt("who wrote hamlet?")               # the paper's Table 1 template (base models)
    proto.build_prompt("who wrote hamlet?", "instruct")   # the same text as a user chat message
    proto.parse_turn("<think>…</think><search> hamlet author </search>")  # Action(kind="search", queries=[…])
    await proto.observe(action, search, topk=3)  # '\\n\\n<information>Doc 1(Title: "Hamlet") …</information>\\n\\n'
"""

from __future__ import annotations

from rsearch_verl.rewards.formats import extract_tag
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

    # ---- prompts ----------------------------------------------------------------------------------------------
    def _check_variant(self, variant: str) -> None:
        if variant not in ("base", "instruct"):
            raise ValueError(f"prompt variant must be 'base' or 'instruct', got {variant!r}")

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


SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search>, and it will return the top searched results between <information> and "
    "</information>. You can search as many times as you want. If you find no further external knowledge needed, "
    "you can directly provide the answer inside <answer> and </answer> without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: {question}\n"
)


class SearchR1Protocol(TagSearchProtocol):
    """Search-R1's protocol; the instruct variant sends the same template as the user turn (as the paper does)."""

    name = "search_r1"
    stop_strings = ["</search>", "</answer>"]
    observation_open = "<information>"
    observation_close = "</information>"

    def build_prompt(self, question: str, variant: str = "base") -> str | list[dict[str, str]]:
        self._check_variant(variant)
        text = SEARCH_R1_TEMPLATE.format(question=question.strip())
        return text if variant == "base" else [{"role": "user", "content": text}]
