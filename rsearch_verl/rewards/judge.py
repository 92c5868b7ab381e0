"""Client for a judge model behind an OpenAI-compatible chat endpoint (`POST {url}/v1/chat/completions`).

    client = JudgeClient(cfg.reward.judge)               # JudgeConfig: url, model, api_key_env, timeout_s, ...
    replies = client.chat_batch([[{"role": "user", "content": "..."}], ...])   # list[str | None]

Any server works: a local vLLM / HF server we launch (`vllm serve MODEL`), or a provider. Calls are issued
concurrently (asyncio.gather, at most `max_concurrency` in flight), each with a timeout and up to
`max_retries` retries with exponential backoff on transport errors, 429 and 5xx. A call that still fails
returns None: the reward using it scores that item 0 with metric `judge_error=1` instead of crashing the step.
The API key is read from the environment variable `api_key_env` (sent as a Bearer token only when set).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import httpx

logger = logging.getLogger(__name__)
T = TypeVar("T")
_RETRY_STATUS = {408, 409, 425, 429}


def require_judge_url(judge_cfg: Any, reward_name: str) -> None:
    """Raise a clear error when a judge-based reward has no endpoint configured."""
    if judge_cfg is None or not getattr(judge_cfg, "url", None):
        raise ValueError(
            f"reward.judge.url must be set for {reward_name} (an OpenAI-compatible endpoint); "
            f"for CPU toy runs without a judge set reward.kwargs.judge=f1 (an offline stand-in, not the paper's)"
        )


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion from sync code, also when the caller already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="judge-client")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class JudgeClient:
    def __init__(self, judge_cfg: Any, temperature: float = 0.0, max_tokens: int = 64, backoff_s: float = 0.5):
        require_judge_url(judge_cfg, "a judge-based reward")
        self.url = judge_cfg.url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[: -len("/v1")]  # accept both ".../v1" and the bare server address
        self.model = judge_cfg.model
        self.timeout_s = float(judge_cfg.timeout_s)
        self.max_retries = int(judge_cfg.max_retries)
        self.max_concurrency = max(1, int(judge_cfg.max_concurrency))
        self.temperature, self.max_tokens, self.backoff_s = temperature, max_tokens, backoff_s
        key = os.environ.get(judge_cfg.api_key_env) if judge_cfg.api_key_env else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def _post_once(self, client: httpx.AsyncClient, messages: list[dict[str, str]]) -> str:
        body = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        resp = await client.post(f"{self.url}/v1/chat/completions", json=body, headers=self.headers)
        resp.raise_for_status()
        content = resp.json()["choices"][0]["message"]["content"]
        if not isinstance(content, str):
            raise ValueError(f"judge reply content is {type(content).__name__}, not a string")
        return content

    async def _chat(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, messages: list[dict[str, str]]):
        async with sem:
            for attempt in range(self.max_retries + 1):
                try:
                    return await self._post_once(client, messages)
                except httpx.HTTPStatusError as exc:
                    status = exc.response.status_code
                    retry = status >= 500 or status in _RETRY_STATUS
                    err = f"HTTP {status}: {exc.response.text[:200]}"
                except (httpx.TransportError, httpx.TimeoutException) as exc:
                    retry, err = True, f"{type(exc).__name__}: {exc}"
                except (ValueError, KeyError, IndexError, TypeError) as exc:
                    retry, err = False, f"malformed judge reply: {exc!r}"
                if not retry or attempt == self.max_retries:
                    logger.warning("judge call failed after %d attempt(s): %s", attempt + 1, err)
                    return None
                await asyncio.sleep(self.backoff_s * 2**attempt)
        return None

    async def achat_batch(self, batch: list[list[dict[str, str]]]) -> list[str | None]:
        """One reply per conversation (None where the judge failed), in order."""
        if not batch:
            return []
        sem = asyncio.Semaphore(self.max_concurrency)
        limits = httpx.Limits(max_connections=self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
            return list(await asyncio.gather(*(self._chat(client, sem, m) for m in batch)))

    def chat_batch(self, batch: list[list[dict[str, str]]]) -> list[str | None]:
        return run_sync(self.achat_batch(batch))


def judged_scores(
    judge_cfg: Any,
    todo: list[int],
    prompt: Callable[[int], str],
    score: Callable[[int, str], float | None],
    out: list[tuple[float, float]],
    **client_kwargs: Any,
) -> list[tuple[float, float]]:
    """Ask the judge about every index in `todo` (one user message each, `prompt(i)`) as one batch; set
    `out[i] = (score(i, reply), 0.0)`, or `(0.0, 1.0)` -- a judge error -- when the reply is missing or `score` cannot
    read it (None). Returns `out`."""
    messages = [[{"role": "user", "content": prompt(i)}] for i in todo]
    replies = JudgeClient(judge_cfg, **client_kwargs).chat_batch(messages) if messages else []
    for i, reply in zip(todo, replies, strict=True):
        value = None if reply is None else score(i, reply)
        out[i] = (0.0, 1.0) if value is None else (value, 0.0)
    return out
