"""One rollout and one update per model family x protocol, on CPU: the tiny random Qwen2 (model=tiny), Qwen3
(model=tiny_qwen3, thinking off) and Llama 3 (model=tiny_llama3), each through its own chat template, with Search-R1's
tag protocol (`search_r1`, plain text) and the JSON tool-call protocol (`tool_call`: Hermes calls for the Qwen families,
Llama 3 JSON calls for Llama 3); and the Qwen3.5 / 3.6 hybrids (model=tiny_qwen3_5, thinking on, with `tool_call` in
Qwen3.5's XML call form; model=tiny_qwen3_6_moe with `search_r1`).

Each case runs the product's pieces in this process: the real `ActorWorker` (FSDP2 over a 1-rank gloo group, float32
masters), the HF engine with its turns scripted (a random policy never searches by itself) and built from the same
seeded weights, `generate_batch` (which checks the token round trip: chat templates are on), the driver's phases
(loss mask, rewards, old and reference log-probs, advantages) and `update_actor`. Checked: one search and an
EM-scored answer per trajectory (one right, one wrong: REINFORCE++ gives them opposite advantages), the engine's
log-probs equal the actor's (< 1e-4: the same ids reach both), and the update moves the weights.

Run: .venv/bin/python -m pytest -q tests/workers/test_workers_families.py
"""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch

from rsearch_verl.config import load_config, to_dict
from rsearch_verl.data.dataset import PromptDataset
from rsearch_verl.models import load_model
from rsearch_verl.rollout.agent_loop import generate_batch
from rsearch_verl.rollout.protocols import protocol_for
from rsearch_verl.search.types import Doc
from rsearch_verl.testing.scripted_engines import ScriptedHFEngine
from rsearch_verl.trainer import phases

GROUPS = {"qwen2": ["model=tiny", "model.sft_checkpoint=null", "model.use_chat_template=true"],
          "qwen3": ["model=tiny_qwen3"], "llama3": ["model=tiny_llama3"],
          # thinking on, the real models' default: the generation prompt opens <think> itself
          "qwen3_5": ["model=tiny_qwen3_5", "model.thinking=on"],
          "qwen3_5_moe": ["model=tiny_qwen3_6_moe"]}  # fmt: skip
CALLS = {
    "search_r1": "<search> Hamlet </search>",
    "tool_call": '<tool_call>\n{"name": "search", "arguments": {"query": "Hamlet"}}\n</tool_call>',
    "tool_call/llama3": '{"name": "search", "parameters": {"query": "Hamlet"}}<|eom_id|>',
    "tool_call/qwen3_5": "<tool_call>\n<function=search>\n<parameter=query>\nHamlet\n</parameter>\n</function>\n"
    "</tool_call>",
}
QUESTIONS = [("who wrote hamlet?", "Shakespeare"), ("what is the capital of france?", "Paris")]


@pytest.fixture(scope="module")
def process_group():
    """A 1-rank gloo group in this process (what `ActorWorker.init_model` joins on a Ray worker)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "REDIS_STORE_SERVER_HOST": "127.0.0.1"}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


async def _search(queries, topk, source="local"):
    return [[Doc("hamlet", '"Hamlet"\nHamlet is a tragedy by William Shakespeare.')] for _ in queries]


def _script(call: str):
    def script(ctx: str) -> str:  # search once, then answer Shakespeare (right for one question, wrong for the other)
        return call if "(Title: " not in ctx else "<think> found it </think><answer> Shakespeare </answer>"

    return script


@pytest.mark.parametrize("protocol_name", ["search_r1", "tool_call"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3"])
def test_one_rollout_and_one_update(process_group, family, protocol_name):
    # heavy: the worker module pulls in Ray and verl's worker machinery
    from rsearch_verl.workers import fsdp
    from rsearch_verl.workers.actor import ActorWorker

    recipe = "search_r1_grpo" if protocol_name == "search_r1" else "search_r1_toolcall_grpo"
    cfg = load_config([f"+recipe={recipe}", *GROUPS[family], "trainer=cpu", "rollout.n=1", "data.train_batch_size=2",
                       "algorithm.adv_estimator=reinforce_plus_plus", "actor.ppo_mini_batch_size=2",
                       "actor.micro_batch_size=2", "actor.optim.lr=1e-3", "rollout.max_turns=3",
                       "rollout.max_tokens_per_turn=96", "rollout.max_response_length=400",
                       "data.max_prompt_length=1024"])  # fmt: skip
    assert cfg.model.family in (family, None) and cfg.prompt_variant == "instruct"
    worker = ActorWorker(to_dict(cfg), with_rollout=False)
    worker.init_model()
    tok, protocol = worker.tokenizer, protocol_for(cfg)
    before = {k: v.clone() for k, v in fsdp.full_state_dict(worker.model).items()}
    call = CALLS.get(f"{protocol_name}/{family}", CALLS[protocol_name])
    engine = ScriptedHFEngine(load_model(cfg.model, tok, seed=cfg.seed), tok, _script(call))  # the actor's weights
    rows = [{"prompt": protocol.build_prompt(q, cfg.prompt_variant), "golden_answers": [a], "question": q}
            for q, a in QUESTIONS]  # fmt: skip
    prompts = PromptDataset(rows, tok, cfg.data.max_prompt_length, protocol=protocol).to_batch([0, 1], ["a", "b"])
    prompts.meta_info["seed"] = 1
    try:
        batch = generate_batch(engine, tok, prompts, cfg, search=_search, protocol=protocol)
    finally:
        engine.close()
    assert batch.meta_info["metrics"]["round_trip/trajectories"] == 2  # checked: a chat-template run
    assert list(batch.non_tensor_batch["n_searches"]) == [1, 1]
    batch, _ = phases.rollout_phase(batch)
    batch, _ = phases.loss_mask_phase(batch, cfg, 1)
    batch, _ = phases.worker_args_phase(batch, cfg, 1)
    batch, metrics = phases.reward_phase(batch, cfg, protocol)
    assert metrics["reward/mean"] == 0.5  # EM: Shakespeare is right for Hamlet, wrong for France
    batch = batch.union(worker.compute_log_prob(batch))
    batch, gap = phases.logprob_check_phase(batch, 1)
    assert gap["rollout/logprob_abs_diff_max"] < 1e-4  # the engine sampled exactly what the actor scores
    if cfg.use_ref:  # the recipes' KL loss to the reference
        batch = batch.union(worker.compute_ref_log_prob(batch))
    batch, _ = phases.advantage_phase(batch, cfg, 1)
    out = worker.update_actor(batch).meta_info["metrics"]
    assert math.isfinite(out["actor/pg_loss"]) and out["actor/grad_norm"] > 0
    after = fsdp.full_state_dict(worker.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the update moved the weights


@pytest.mark.slow  # ~25-60 s each here: the 248k vocabulary's tokenizer and LM head, torch's delta-rule path
@pytest.mark.parametrize(("family", "protocol_name"), [("qwen3_5", "tool_call"), ("qwen3_5_moe", "search_r1")])
def test_hybrid_one_rollout_and_one_update(process_group, family, protocol_name):
    """The same for the Qwen3.5 / 3.6 stand-ins (model=tiny_qwen3_5, tiny_qwen3_6_moe: Gated DeltaNet hybrids with the
    real 248k vocabulary), one protocol each: padded micro-batches (the hybrids' only layout), engine and actor
    log-probs within 1e-4, weights move."""
    test_one_rollout_and_one_update(process_group, family, protocol_name)
