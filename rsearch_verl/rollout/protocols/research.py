"""ReSearch (Chen et al. 2025): `<search> q </search>` inside the reasoning, results in `<result>…</result>`,
final answer `<answer> The final answer is \\boxed{…} </answer>`.

    proto = ReSearchProtocol()
    proto.build_prompt(q)              # the paper's base-model template, ending in "Assistant:"
    proto.build_prompt(q, "instruct")  # [{"role": "system", <the paper's system prompt>}, {"role": "user", q}]
    proto.extract_answer(segments)     # the \\boxed{} content of the last <answer> block of the policy text

Results are written as in the paper's case study: one `"Title", text` line per passage.
"""

from __future__ import annotations

from rsearch_verl.formats import extract_boxed, extract_tag
from rsearch_verl.rollout.protocols.tagged import TagSearchProtocol
from rsearch_verl.search.types import Doc

_FORMAT_TEXT = (
    "The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags "
    "respectively, and the search query and result are enclosed within <search> </search> and <result> "
    "</result> tags respectively. For example, <think> This is the reasoning process. </think> <search> search "
    "query here </search> <result> search result here </result> <think> This is the reasoning process. </think> "
    "<answer> The final answer is \\boxed{answer here} </answer>. In the last part of the answer, the final exact "
    "answer is enclosed within \\boxed{} with latex format."
)

RESEARCH_BASE_TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the assistant solves it. The "
    "assistant first thinks about the reasoning process in the mind and then provides the user with the answer. "
    "During thinking, the assistant can invoke the wikipedia search tool to search for fact information about "
    "specific topics if needed. " + _FORMAT_TEXT + " User: {question}. Assistant:"
)

RESEARCH_SYSTEM_PROMPT = (
    "You are a helpful assistant that can solve the given question step by step with the help of the wikipedia "
    "search tool. Given a question, you need to first think about the reasoning process in the mind and then "
    "provide the answer. During thinking, you can invoke the wikipedia search tool to search for fact information "
    "about specific topics if needed. " + _FORMAT_TEXT
)


class ReSearchProtocol(TagSearchProtocol):
    name = "research"
    stop_strings = ["</search>", "</answer>"]
    observation_open = "<result>"
    observation_close = "</result>"
    obs_prefix = " "
    obs_suffix = " "
    system_prompt = RESEARCH_SYSTEM_PROMPT
    demo_format = (
        "<think> {t} </think>\n",
        "<search> {q} </search>",
        "<answer> The final answer is \\boxed{{{a}}} </answer>",
    )

    def base_prompt(self, question: str) -> str:
        # the template puts a period after the question; do not double an existing one
        template = RESEARCH_BASE_TEMPLATE
        if self.tools_text:  # the run's other tools (rollout.tools): their sentences after the format instructions
            template = template.replace(" User: {question}", f" {self.tools_text} User: {{question}}")
        return template.replace("{question}", question.rstrip("."))

    def format_docs(self, docs: list[Doc]) -> str:
        lines = [f'"{d.title}", {" ".join(d.text.split())}' for d in docs]
        return "\n" + "\n".join(lines) + "\n"

    def answer_in(self, policy: str) -> str | None:
        """`\\boxed{}` content of the last `<answer>` block; None without a box (the paper scores only boxed): a box
        outside the answer block (a truncated "<think> maybe \\boxed{Paris}? let me search") is no answer."""
        block = extract_tag(policy, self.answer_tag)
        return extract_boxed(block) if block is not None else None
