"""Search-R1 (Jin et al. 2025): `<think>`, `<search> q </search>`, `<information>…</information>`, `<answer>`.

proto = SearchR1Protocol()
proto.build_prompt("who wrote hamlet?")               # the paper's Table 1 template (base models)
proto.build_prompt("who wrote hamlet?", "instruct")   # the same text as a user chat message
proto.parse_turn("<think>…</think><search> hamlet author </search>")  # Action(kind="search", queries=[…])
await proto.observe(action, search, topk=3)  # '\\n\\n<information>Doc 1(Title: "Hamlet") …</information>\\n\\n'
"""

from __future__ import annotations

from rsearch_verl.rollout.protocols.tagged import TagSearchProtocol

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

    def base_prompt(self, question: str) -> str:
        text = SEARCH_R1_TEMPLATE.format(question=question)
        if self.tools_text:  # the run's other tools (rollout.tools): their sentences go before the question
            at = text.rindex(" Question: ")
            text = f"{text[:at]} {self.tools_text}{text[at:]}"
        return text

    def chat_prompt(self, question: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.base_prompt(question)}]
