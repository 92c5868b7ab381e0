"""R-Search with evidence (multi-reward R-Search): `<search> q </search>`, `<observation>…</observation>`
inserted by the environment (masked), `<original_evidence>…</original_evidence>` written by the policy (NOT
masked: it is generated text the evidence reward scores), then `<answer>`.

    proto = RSearchProtocol()
    proto.build_prompt(q, "instruct")   # [system: the paper's rollout template, user: q]
    proto.extract_evidence(response)    # the policy's last evidence block (for the evidence reward)

Passages are written as in the paper's case study: `(Title: "t") text`, one per line.
"""

from __future__ import annotations

from collections.abc import Sequence

from rsearch_verl.formats import extract_tag
from rsearch_verl.rollout.protocols.tagged import TagSearchProtocol
from rsearch_verl.search.types import Doc
from rsearch_verl.segments import Segment, policy_text

R_SEARCH_SYSTEM_PROMPT = (
    "You are a helpful assistant that can solve the given question step by step. For each step, start by "
    "explaining your thought process. If additional information is needed, provide a specific query enclosed in "
    "<search> and </search>. The system will return the top search results within <observation> and "
    "</observation>. You can perform multiple searches as needed. When you know the final answer, use "
    "<original_evidence> and </original_evidence> to provide all potentially relevant original information from "
    "the observations. Ensure the information is complete and preserves the original wording without "
    "modification. If no searches were conducted or observations were made, omit the evidence section. Finally, "
    "provide the final answer within <answer> and </answer> tags."
)

EVIDENCE_TAG = "original_evidence"


class RSearchProtocol(TagSearchProtocol):
    name = "r_search"
    stop_strings = ["</search>", "</answer>"]
    observation_open = "<observation>"
    observation_close = "</observation>"
    obs_prefix = "\n"
    obs_suffix = "\n"
    system_prompt = R_SEARCH_SYSTEM_PROMPT
    # no <think> tags (the paper's template asks for plain reasoning); the supporting passages' text, unmodified, as
    # evidence before the answer (policy text: the evidence reward scores it)
    demo_format = ("{t}\n", "<search> {q} </search>", "<answer> {a} </answer>")
    demo_evidence = f"<{EVIDENCE_TAG}> {{e}} </{EVIDENCE_TAG}>\n"

    def format_docs(self, docs: list[Doc]) -> str:
        return " " + "\n".join(f'(Title: "{d.title}") {" ".join(d.text.split())}' for d in docs) + " "

    def extract_evidence(self, response: str | Sequence[Segment]) -> str | None:
        """The policy's last `<original_evidence>` block (in policy text, as `extract_answer` reads it), or None."""
        return extract_tag(policy_text(self.segments_of(response)), EVIDENCE_TAG)
