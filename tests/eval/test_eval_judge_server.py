"""`python -m rsearch_verl.eval --judge` scoring (rsearch_verl/eval/judged.py) against a real judge: a tiny Qwen2 served
by our OpenAI-compatible chat server (rsearch_verl/testing/chat_server.py: FastAPI + transformers generate, uvicorn
on 127.0.0.1). One copy of the model is rigged to answer "yes" to everything (its layers write nothing, its head
reads one hidden dimension that the prompt's last token sets), so real generated verdicts come back; the untouched
random copy answers noise, which is an unreadable verdict. Failures are counted, never raised: an unknown model
(HTTP 404, not retried), a server that accepts connections and never answers (the client's timeout), noise."""

from __future__ import annotations

import copy
import logging
import socket
import time

import httpx
import pytest
import torch

from rsearch_verl.config import JudgeConfig
from rsearch_verl.eval.evaluate import COLUMNS, summarise
from rsearch_verl.eval.judged import judge_prompt, judge_rows, parse_verdict
from rsearch_verl.testing.chat_server import create_chat_app, generate_reply, load
from rsearch_verl.testing.servers import serve_in_thread


def yes_model(model, tokenizer):
    """`model` rigged so greedy decoding answers every chat prompt with "yes" and then stops."""
    gen_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True)
    last = (gen_prompt if isinstance(gen_prompt, list) else gen_prompt["input_ids"])[-1]
    yes, eos = tokenizer.encode("yes")[0], tokenizer.eos_token_id
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream stays the input embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb[last, 0], emb[yes, 0] = 1.0, -1.0  # after the prompt: +; after "yes": -
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        head = torch.zeros_like(emb)
        head[yes, 0], head[eos, 0] = 50.0, -50.0
        model.lm_head.weight = torch.nn.Parameter(head)  # untied from the embedding
    return model


@pytest.fixture(scope="module")
def judges():
    model, tokenizer = load("tiny")
    rigged = yes_model(copy.deepcopy(model), tokenizer)
    servers = [serve_in_thread(create_chat_app(m, tokenizer, model_name="judge")) for m in (rigged, model)]
    yield {"yes": (servers[0][2], rigged), "noise": (servers[1][2], model), "tokenizer": tokenizer}
    for srv, thread, _ in servers:
        srv.should_exit = True
        thread.join(timeout=10)


def eval_rows() -> list[dict]:
    """Rows as eval/evaluate.py's example_rows writes them (the fields the judge reads)."""
    answers = ["Seine", "the Loire", "", "Mount Vesuvius"]
    golds = [["Seine"], ["Seine"], ["Seine"], ["Vesuvius", "Mount Vesuvius"]]
    return [
        {"id": f"q{i}", "question": f"Question {i}?", "golden_answers": g, "answer": a, **dict.fromkeys(COLUMNS, 0.0)}
        for i, (a, g) in enumerate(zip(answers, golds, strict=True))
    ]


def judge_cfg(url: str, **kw) -> JudgeConfig:
    return JudgeConfig(**{"url": url, "model": "judge", "timeout_s": 60.0, "max_retries": 1, **kw})


def test_server_speaks_openai_chat(judges):
    url, _ = judges["yes"]
    body = {"model": "judge", "messages": [{"role": "user", "content": "Is Paris in France?"}], "max_tokens": 8}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "yes"}
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == 2
    missing = httpx.post(f"{url}/v1/chat/completions", json={**body, "model": "gpt-4o"}, timeout=60)
    assert missing.status_code == 404 and "'gpt-4o' not found" in missing.json()["detail"]
    assert httpx.post(f"{url}/v1/chat/completions", json={**body, "messages": []}, timeout=60).status_code == 400
    assert httpx.post(f"{url}/v1/chat/completions", json={"model": "judge"}, timeout=60).status_code == 422
    assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == "judge"


def test_judge_column_from_real_generations(judges):
    url, _ = judges["yes"]
    rows = eval_rows()
    assert judge_rows(rows, judge_cfg(url)) == 0
    assert [r["judge"] for r in rows] == [1.0, 1.0, 0.0, 1.0]  # a yes-man; the empty answer is never sent
    assert [r["judge_reply"] for r in rows] == ["yes", "yes", None, "yes"]
    assert all(r["judge_error"] == 0.0 for r in rows)
    table = summarise({"bcp": rows})
    assert table["bcp"]["judge"] == pytest.approx(0.75) and table["bcp"]["judge_errors"] == 0

    url, model = judges["noise"]  # the random model: what it says is what the server returned, and unreadable
    rows = eval_rows()
    errors = judge_rows(rows, judge_cfg(url))
    for row in rows:
        if row["answer"]:
            messages = [{"role": "user", "content": judge_prompt(row)}]
            assert row["judge_reply"] == generate_reply(model, judges["tokenizer"], messages, 8, 0.0, None)[0]
    assert errors == sum(parse_verdict(r["judge_reply"]) is None for r in rows if r["answer"])
    assert all(r["judge"] == 0.0 for r in rows if r["judge_error"])


def test_unknown_model_4xx_is_counted(judges, caplog):
    url, _ = judges["yes"]
    rows = eval_rows()
    with caplog.at_level(logging.WARNING, logger="rsearch_verl"):
        errors = judge_rows(rows, judge_cfg(url, model="gpt-4o", max_retries=3))
    assert errors == 3 and [r["judge_error"] for r in rows] == [1.0, 1.0, 0.0, 1.0]
    assert all(r["judge"] == 0.0 for r in rows)
    assert "after 1 attempt(s): HTTP 404" in caplog.text  # a 4xx is not retried
    assert "failed on all 3 answers" in caplog.text and url in caplog.text
    assert summarise({"bcp": rows})["bcp"]["judge_errors"] == 3


def test_judge_timeout_is_counted():
    with socket.socket() as black_hole:  # accepts connections (the kernel's backlog), never answers
        black_hole.bind(("127.0.0.1", 0))
        black_hole.listen(16)
        url = f"http://127.0.0.1:{black_hole.getsockname()[1]}"
        rows = eval_rows()
        start = time.monotonic()
        errors = judge_rows(rows, judge_cfg(url, timeout_s=0.3, max_retries=1))
        elapsed = time.monotonic() - start
    assert errors == 3 and rows[0]["judge_error"] == 1.0 and rows[0]["judge_reply"] is None
    assert elapsed < 5.0  # 2 tries of 0.3 s and one backoff, concurrently for the 3 answers


def test_parse_verdict():
    assert parse_verdict("Yes.") == 1.0 and parse_verdict("  correct, it matches") == 1.0
    assert parse_verdict("No, it is Lyon") == 0.0 and parse_verdict("Incorrect") == 0.0
    assert parse_verdict("maybe yes") is None and parse_verdict("\n\n") is None and parse_verdict(None) is None
