"""R1-Searcher (Song et al. 2025): queries in `<|begin_of_query|> … <|end_of_query|>`, documents in
`<|begin_of_documents|> … <|end_of_documents|>` (added to the tokenizer as special tokens), `<answer>`.

    proto = R1SearcherProtocol()
    tokenizer.add_special_tokens({"additional_special_tokens": proto.special_tokens})
    proto.build_prompt(q)              # the paper's base-model system prompt, then "User: q" / "Assistant: <think>"
    proto.build_prompt(q, "instruct")  # the same system prompt as a system message + the question as user

Generation pauses at `<|end_of_query|>`; stopping at `</answer>` ends the trajectory.
"""

from __future__ import annotations

from rsearch_verl.rollout.protocols.tagged import TagSearchProtocol
from rsearch_verl.search.types import Doc

R1_SEARCHER_SYSTEM_PROMPT = (
    "The User asks a question, and the Assistant solves it. The Assistant first thinks about the reasoning process "
    "in the mind and then provides the User with the final answer. The output format of reasoning process and final "
    'answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "<think> '
    'reasoning process here </think><answer> final answer here </answer>". During the thinking process, the '
    "Assistant can perform searching for uncertain knowledge if necessary with the format of "
    '"<|begin_of_query|> search query (only list keywords, such as "keyword_1 keyword_2 ...")<|end_of_query|>". '
    "A query must involve only a single triple. Then, the search system will provide the Assistant with the "
    'retrieval information with the format of "<|begin_of_documents|> ...search results... <|end_of_documents|>".'
)


class R1SearcherProtocol(TagSearchProtocol):
    name = "r1_searcher"
    query_open = "<|begin_of_query|>"
    query_close = "<|end_of_query|>"
    observation_open = "<|begin_of_documents|>"
    observation_close = "<|end_of_documents|>"
    stop_strings = ["<|end_of_query|>", "</answer>"]
    special_tokens = ["<|begin_of_query|>", "<|end_of_query|>", "<|begin_of_documents|>", "<|end_of_documents|>"]
    system_prompt = R1_SEARCHER_SYSTEM_PROMPT
    demo_format = ("<think> {t} </think>\n", "<|begin_of_query|> {q} <|end_of_query|>", "<answer> {a} </answer>")

    def base_prompt(self, question: str) -> str:
        return f"{self.instructions()}\nUser: {question}\nAssistant: <think>"

    def format_docs(self, docs: list[Doc]) -> str:
        return "\n" + "".join(f"({i}) {d.title}: {' '.join(d.text.split())}\n" for i, d in enumerate(docs, 1))
