"""Segments: a response as the ordered pieces the policy sampled and the environment inserted, and THE definition of
policy text.

A segment is `(role, text)` with role "policy" (sampled: response_mask 1) or "observation" (inserted by the
environment: response_mask 0); the agent loop records them per trajectory (`batch.non_tensor_batch["segments"]`)
and they join to the response text. Policy text is exactly the policy segments, joined in order. A block that looks
like an observation but was written by the policy (a forged `<information>…</information>`) is policy text, as its
tokens are trained (mask 1); an answer inside a real observation is never policy text.

    policy_text([("policy", "<search> q </search>"), ("observation", "<information>…</information>"),
                 ("policy", "<answer> Paris </answer>")])           # -> "<search> q </search><answer> Paris </answer>"
    segments_from_text(text, "<information>", "</information>")    # text without a recorded mask (see below)

Rewards (`RewardInput.policy_text`), the protocols (`SearchProtocol.extract_answer`) and the rollout viewer all read
policy text through `policy_text`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

POLICY, OBSERVATION = "policy", "observation"
Segment = tuple[str, str]  # (role, text)


def policy_text(segments: Iterable[Segment]) -> str:
    """The text of the policy segments, joined in order without separators (observations left out)."""
    parts = []
    for role, text in segments:
        if role not in (POLICY, OBSERVATION):
            raise ValueError(f"segment role must be {POLICY!r} or {OBSERVATION!r}, got {role!r}")
        if role == POLICY:
            parts.append(text)
    return "".join(parts)


def segments_from_text(text: str, open_tag: str, close_tag: str) -> list[Segment]:
    """Segments of a response for which no mask was recorded (a hand-written example, an old dump): every complete
    `open_tag…close_tag` block is taken as an observation, the rest as policy text.

    This is a reconstruction, not the record: without the mask a block the policy forged cannot be told from one the
    environment inserted, so it counts as an observation (an answer inside it is not extracted). Pass the recorded
    segments whenever they exist."""
    if not open_tag or not close_tag:
        return [(POLICY, text)]
    pattern = re.compile(re.escape(open_tag) + r".*?" + re.escape(close_tag), flags=re.DOTALL)
    segments: list[Segment] = []
    pos = 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            segments.append((POLICY, text[pos : m.start()]))
        segments.append((OBSERVATION, m.group(0)))
        pos = m.end()
    if pos < len(text) or not segments:
        segments.append((POLICY, text[pos:]))
    return segments
