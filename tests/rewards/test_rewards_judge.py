"""Judge client and judge-based rewards against a real local fake OpenAI endpoint (FastAPI + uvicorn, 127.0.0.1).

The fake judge answers the evidence template with "Paris" when the passages mention Paris, grades answers
"0.9" / "0.1", and misbehaves on request: FAIL500 in the prompt -> HTTP 500, SLOW -> sleeps past the client
timeout, FLAKY -> one 500 then a good reply.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import Counter

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rsearch_verl.config import JudgeConfig
from rsearch_verl.rewards import RewardInput, compute_rewards
from rsearch_verl.rewards.judge import JudgeClient, run_sync


class FakeJudge:
    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.auth: list[str | None] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self.chat)

    async def chat(self, request: Request):
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        self.calls[prompt] += 1
        self.auth.append(request.headers.get("authorization"))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.05)  # long enough for concurrent requests to overlap
            if "FAIL500" in prompt or ("FLAKY" in prompt and self.calls[prompt] == 1):
                return JSONResponse({"error": "boom"}, status_code=500)
            if "SLOW" in prompt:
                await asyncio.sleep(3)
            if "Reply with only the number" in prompt:
                pred = prompt.split("Predicted answer:")[1].split("\n")[0]
                reply = "0.9" if "Paris" in pred else "0.1"
            else:
                passages = prompt.split("Question:")[0]
                reply = "Paris" if "Paris" in passages else "I do not know"
            return {"choices": [{"message": {"role": "assistant", "content": reply}}], "model": body["model"]}
        finally:
            self.in_flight -= 1


@pytest.fixture(scope="module")
def fake_judge():
    judge = FakeJudge()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(judge.app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake judge did not start"
        time.sleep(0.05)
    judge.url = f"http://127.0.0.1:{port}"
    yield judge
    server.should_exit = True
    thread.join(timeout=10)


def cfg(judge: FakeJudge, **kw) -> JudgeConfig:
    base = {
        "url": judge.url,
        "model": "fake-judge",
        "api_key_env": "FAKE_JUDGE_KEY",
        "timeout_s": 5.0,
        "max_retries": 1,
    }
    return JudgeConfig(**{**base, **kw})


def evidence_item(evidence: str, question: str = "What is the capital of France?") -> RewardInput:
    segments = [
        ("policy", "<search>capital of France</search>"),
        ("observation", "<observation>Paris is the capital of France.</observation>"),
        ("policy", f"<original_evidence>{evidence}</original_evidence><answer>Paris</answer>"),
    ]
    return RewardInput(
        response="".join(t for _, t in segments),
        segments=segments,
        ground_truth=["Paris"],
        question=question,
        extra={"n_searches": 1},
    )


def test_judge_requires_url():
    with pytest.raises(ValueError, match="reward.judge.url must be set"):
        JudgeClient(JudgeConfig())


def test_evidence_reward_batched_and_bounded(fake_judge, monkeypatch):
    monkeypatch.setenv("FAKE_JUDGE_KEY", "sekrit")
    items = [evidence_item("Paris is the capital.", question=f"Q{i}: capital?") for i in range(8)]
    items.append(evidence_item("Lyon is a city."))
    fake_judge.max_in_flight = 0
    results = compute_rewards("r_search_evidence", items, judge_cfg=cfg(fake_judge, max_concurrency=3))
    assert [r.metrics["evidence"] for r in results] == [1.0] * 8 + [0.0]
    assert results[0].score == pytest.approx(1.0 + 1.0 + 0.4)
    assert all(r.metrics["judge_error"] == 0.0 for r in results)
    assert 1 < fake_judge.max_in_flight <= 3  # concurrent, but never above max_concurrency
    assert fake_judge.auth[-1] == "Bearer sekrit"


def test_judge_500_scores_zero_not_crash(fake_judge):
    items = [evidence_item("FAIL500 Paris"), evidence_item("Paris, FLAKY"), evidence_item("Paris again")]
    results = compute_rewards("r_search_evidence", items, judge_cfg=cfg(fake_judge, max_retries=2))
    assert results[0].metrics["judge_error"] == 1.0 and results[0].metrics["evidence"] == 0.0
    assert results[0].score == pytest.approx(1.0 + 0.4)  # answer F1 and format still count
    assert fake_judge.calls[next(p for p in fake_judge.calls if "FAIL500" in p)] == 3  # 1 try + 2 retries
    assert results[1].metrics["judge_error"] == 0.0 and results[1].metrics["evidence"] == 1.0  # retried
    assert results[2].metrics["evidence"] == 1.0


def test_judge_timeout(fake_judge):
    t0 = time.monotonic()
    results = compute_rewards(
        "r_search_evidence", [evidence_item("SLOW Paris")], judge_cfg=cfg(fake_judge, timeout_s=0.3, max_retries=1)
    )
    assert results[0].metrics["judge_error"] == 1.0
    assert time.monotonic() - t0 < 3.0


def test_dag_reward_with_judge(fake_judge):
    def dag_item(answer: str) -> RewardInput:
        segments = [
            ("policy", "<think>t</think><search>A: capital of France (Wiki)</search>"),
            ("observation", "<result>[A] Paris</result>"),
            ("policy", f"<answer>{answer}</answer>"),
        ]
        return RewardInput("".join(t for _, t in segments), segments, ["Paris"], question="Capital of France?")

    good, bad = compute_rewards("r_search_dag", [dag_item("Paris"), dag_item("Lyon")], judge_cfg=cfg(fake_judge))
    assert good.metrics["answer_score"] == pytest.approx(0.9) and good.score == pytest.approx(0.5 + 0.45)
    assert bad.metrics["answer_score"] == pytest.approx(0.1)


def test_url_with_v1_suffix_and_running_loop(fake_judge):
    client = JudgeClient(cfg(fake_judge, url=fake_judge.url + "/v1/"))
    prompt = [{"role": "user", "content": "The following are given passages: Paris\n\nQuestion: q"}]

    async def inside_loop():
        return run_sync(client.achat_batch([prompt]))  # sync API called from async code

    assert asyncio.run(inside_loop()) == ["Paris"]
    assert client.chat_batch([]) == []


def test_unreachable_judge_is_judge_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens here
    bad = JudgeConfig(url=f"http://127.0.0.1:{port}", model="m", timeout_s=1.0, max_retries=1)
    client = JudgeClient(bad, backoff_s=0.01)
    assert client.chat_batch([[{"role": "user", "content": "x"}]]) == [None]
