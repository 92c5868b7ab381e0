"""LLM-as-judge scoring for `python -m rsearch_verl.eval --judge`: a `judge` column (1 = the judge says the answer
is correct) beside EM / F1 / cover-EM, as BrowseComp-style benchmarks grade free-form answers.

    python -m rsearch_verl.eval --checkpoint CKPT --data data/bcp/test.parquet --out outputs/eval_bcp --judge \
        +recipe=search_r1_ppo reward.judge.url=http://127.0.0.1:8001 reward.judge.model=qwen2.5-7b-instruct

The judge is any OpenAI-compatible `/v1/chat/completions` server named by `reward.judge` (url, model, api_key_env,
timeout_s, max_retries, max_concurrency), called through `rsearch_verl.rewards.judge.JudgeClient`: one batch per
dataset, bounded concurrency, a timeout per call, retries on transport errors / 429 / 5xx only. A call that still
fails (a timeout, a 4xx such as an unknown model, an unreadable verdict) never stops the evaluation: that row scores
judge 0 with `judge_error` 1, and the table's `judge_errors` counts them (an evaluation where every call failed
logs an error naming the endpoint). A missing `reward.judge.url` is refused before any model loads.
A row without an extracted answer scores 0 without a call.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from rsearch_verl.rewards.judge import JudgeClient

logger = logging.getLogger(__name__)

JUDGE_PROMPT = (
    "Judge whether the predicted answer to the question is correct, given the correct answer(s). Minor differences "
    "in wording, spelling or format are fine; a different entity, a different number or a hedge is not.\n\n"
    "Question: {question}\nCorrect answer(s): {golds}\nPredicted answer: {answer}\n\n"
    "Is the predicted answer correct? Reply with only yes or no."
)
_YES = {"yes", "correct", "true"}
_NO = {"no", "incorrect", "false", "wrong"}
_WORD = re.compile(r"[a-z]+")


def parse_verdict(reply: str | None) -> float | None:
    """1.0 / 0.0 from the reply's first word (yes / correct / true; no / incorrect / false / wrong); else None."""
    if reply is None:
        return None
    match = _WORD.search(reply.lower())
    if match is None:
        return None
    word = match.group(0)
    return 1.0 if word in _YES else 0.0 if word in _NO else None


def judge_prompt(row: dict) -> str:
    golds = "; ".join(row["golden_answers"])
    return JUDGE_PROMPT.format(question=row["question"], golds=golds, answer=row["answer"])


def judge_rows(rows: list[dict], judge_cfg: Any, max_tokens: int = 8) -> int:
    """Add `judge`, `judge_error` and `judge_reply` to every row (in place); return the number of judge errors."""
    todo = [i for i, row in enumerate(rows) if row["answer"].strip()]
    client = JudgeClient(judge_cfg, max_tokens=max_tokens)  # a missing url is a clear ValueError here
    replies = client.chat_batch([[{"role": "user", "content": judge_prompt(rows[i])}] for i in todo])
    for row in rows:
        row.update(judge=0.0, judge_error=0.0, judge_reply=None)
    errors = 0
    for i, reply in zip(todo, replies, strict=True):
        verdict = parse_verdict(reply)
        rows[i]["judge_reply"] = reply
        if verdict is None:
            errors += 1
            rows[i]["judge_error"] = 1.0
        else:
            rows[i]["judge"] = verdict
    if todo and errors == len(todo):
        logger.error(
            "the judge at %s (model %r) failed on all %d answers: check reward.judge.url / model (logged above)",
            judge_cfg.url,
            judge_cfg.model,
            errors,
        )
    elif errors:
        logger.warning("judge: %d of %d answers not judged (timeouts, 4xx or unreadable verdicts)", errors, len(todo))
    return errors
