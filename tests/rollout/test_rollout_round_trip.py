"""The token-in / token-out round trip (rsearch_verl/rollout/round_trip.py) per model family: 32-turn tool-call
trajectories of the tiny Qwen2 (ChatML), Qwen3 (thinking off) and Llama 3 through `generate_batch` with a scripted HF
engine and each family's own chat template: the check re-renders every turn and passes; a batch that trains
re-tokenised policy ids, or observations framed for another template, fails the run with a clear error. With an engine
that samples non-canonical splits: ids trained as sampled pass, every token counted; a re-tokenisation after the
engine returned (which leaves the loop's own copies agreeing), a context rebuilt from text, or a final batch rebuilt,
shifted or re-positioned on its way to the update (the driver's check) fails.

Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_round_trip.py
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from verl import DataProto

from rsearch_verl.batch import sequence_keys
from rsearch_verl.config import ModelConfig, RSearchConfig, load_config
from rsearch_verl.data.dataset import PromptDataset
from rsearch_verl.model_families import family_tokenizer
from rsearch_verl.models import load_model
from rsearch_verl.rollout import agent_loop
from rsearch_verl.rollout.agent_loop import generate_batch, trajectories_batch
from rsearch_verl.rollout.context import Row, Turn
from rsearch_verl.rollout.engines.base import GenerationResult, RolloutEngine, SamplingParams
from rsearch_verl.rollout.protocols import get_protocol, protocol_for
from rsearch_verl.rollout.protocols.tool_call import ToolCallProtocol
from rsearch_verl.rollout.round_trip import (
    RECORD,
    RoundTripError,
    check_batch_records,
    check_round_trip,
    round_trip_enabled,
)
from rsearch_verl.rollout.stream import SEQ, TrajectoryStream
from rsearch_verl.rollout.trajectory import Trajectory
from rsearch_verl.search.types import Doc
from rsearch_verl.testing.scripted_engines import ScriptedHFEngine
from rsearch_verl.trainer.phases import round_trip_phase

TURNS = 32
CALLS = {
    "qwen2": '<tool_call>{{"name": "search", "arguments": {{"query": "{k}"}}}}</tool_call>',
    "qwen3": '<tool_call>{{"name": "search", "arguments": {{"query": "{k}"}}}}</tool_call>',
    "llama3": '<|python_tag|>{{"name": "search", "parameters": {{"query": "{k}"}}}}<|eom_id|>',
}
TOOL_TURN = {"qwen2": "<|im_start|>tool\n", "qwen3": "<tool_response>", "llama3": "<|start_header_id|>ipython"}


async def _search(queries, topk, source="local"):
    return [[Doc(q, f'"{q}"\n{q}')] for q in queries]


def _cfg(family: str) -> RSearchConfig:
    cfg = RSearchConfig()
    tiny = dataclasses.replace(cfg.model.tiny, max_position_embeddings=8192)
    thinking = False if family == "qwen3" else None
    model = dataclasses.replace(cfg.model, family=family, use_chat_template=True, thinking=thinking, tiny=tiny)
    rollout = dataclasses.replace(cfg.rollout, protocol="tool_call", max_turns=TURNS, max_tokens_per_turn=160,
                                  max_response_length=7200, max_obs_length=96, round_trip_sample=-1)  # fmt: skip
    return dataclasses.replace(cfg, model=model, rollout=rollout)


def _script(family: str):
    """Search `TURNS - 1` times (the last call ends with <|eot_id|> for Llama 3), then answer."""

    def script(ctx: str) -> str:
        done = ctx.count(TOOL_TURN[family]) - (family == "qwen3")  # Qwen3's system turn shows <tool_response> once
        if done < TURNS - 1:
            call = CALLS[family].format(k=done)
            return call.replace("<|eom_id|>", "<|eot_id|>") if done == TURNS - 2 else call
        return "<think> </think><answer> yes </answer>"

    return script


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama3"])
def family_run(request):
    """(family, tokenizer, protocol, batch) of one 32-turn trajectory."""
    family, cfg = request.param, _cfg(request.param)
    tok = family_tokenizer(family)
    model = load_model(cfg.model, tok, seed=0)
    protocol = protocol_for(cfg)
    rows = [{"prompt": protocol.build_prompt("is it so?", "instruct"), "golden_answers": ["yes"]}]
    prompts = PromptDataset(rows, tok, max_prompt_length=2048, protocol=protocol).to_batch([0], uids=["a"])
    prompts.meta_info["seed"] = 3
    engine = ScriptedHFEngine(model, tok, _script(family))
    try:
        batch = generate_batch(engine, tok, prompts, cfg, search=_search, protocol=protocol)
    finally:
        engine.close()
    return family, tok, protocol, batch


def test_32_turns_round_trip_per_family(family_run):
    family, tok, protocol, batch = family_run
    nt, metrics = batch.non_tensor_batch, batch.meta_info["metrics"]
    assert (nt["n_turns"][0], nt["n_searches"][0], nt["finish_reason"][0]) == (TURNS, TURNS - 1, "answer")
    # the check ran (chat template: on by default) and re-rendered every observation
    assert metrics["round_trip/trajectories"] == 1 and metrics["round_trip/observations"] == TURNS - 1
    assert metrics["round_trip/truncated_observations"] == 0
    assert metrics["round_trip/noncanonical_turns"] == 0  # scripted text is the tokenizer's own encoding
    obs = [text for role, text in nt["segments"][0] if role == "observation"]
    frame = {"qwen2": "<|im_end|>\n<|im_start|>tool\n<tool_response>\n", "qwen3": "<|im_end|>\n<|im_start|>user\n",
             "llama3": "<|start_header_id|>ipython<|end_header_id|>\n\n<tool_response>\n"}[family]  # fmt: skip
    assert all(o.startswith(frame) for o in obs) and len(obs) == TURNS - 1
    if family == "qwen3":  # thinking off: every generation prompt, the ones after tool turns too, opens an empty think
        assert all(o.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for o in obs)


def test_observations_framed_for_another_template_fail(family_run):
    family, tok, protocol, batch = family_run
    trajs = _trajectories(batch)
    if family == "qwen3":  # thinking on renders no empty <think> after a tool turn: the inserted ones are wrong
        other = get_protocol("tool_call", enable_thinking=True)
        other.bind_tokenizer(tok, chat=True)
        with pytest.raises(RoundTripError, match="chat template"):
            check_round_trip(trajs, batch, tok, other, sample=1)
    tampered = [_with_obs(t, {3: t.turns[3].obs_ids[:-2] + t.turns[3].obs_ids[-1:]}) for t in trajs]
    with pytest.raises(RoundTripError, match="turn 3"):
        check_round_trip(tampered, _batch(tampered, batch, tok), tok, protocol)


def test_observations_cut_to_their_budget_are_counted_not_failed():
    """A budget of a few tokens cuts an observation inside its frame: counted, not compared with the template."""
    family, cfg = "qwen2", _cfg("qwen2")
    rollout = dataclasses.replace(cfg.rollout, max_turns=3, max_obs_length=6)
    cfg = dataclasses.replace(cfg, rollout=rollout)
    tok, protocol = family_tokenizer(family), protocol_for(cfg)
    rows = [{"prompt": protocol.build_prompt("is it so?", "instruct"), "golden_answers": ["yes"]}]
    prompts = PromptDataset(rows, tok, max_prompt_length=2048, protocol=protocol).to_batch([0], uids=["a"])
    prompts.meta_info["seed"] = 3
    engine = ScriptedHFEngine(load_model(cfg.model, tok), tok, lambda ctx: CALLS[family].format(k=1))
    try:
        batch = generate_batch(engine, tok, prompts, cfg, search=_search, protocol=protocol)
    finally:
        engine.close()
    metrics = batch.meta_info["metrics"]
    assert metrics["round_trip/truncated_observations"] == 2 and metrics["round_trip/observations"] == 0
    assert "[tr" in "".join(text for role, text in batch.non_tensor_batch["segments"][0] if role == "observation")


def test_a_retokenised_policy_turn_fails_the_run():
    """A policy turn sampled as a non-canonical split (`<`, `tool`, ... where the tokenizer would merge): token-in /
    token-out trains it as sampled (counted, not failed); a batch that re-encoded its text trains other ids (fails)."""
    tok = family_tokenizer("llama3")
    protocol = get_protocol("tool_call", call_format="llama3_json")
    protocol.bind_tokenizer(tok, chat=True)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)  # fmt: skip
    text = '{"name": "search", "parameters": {"query": "a"}}'
    sampled = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)] + [tok.convert_tokens_to_ids(
        "<|eom_id|>")]  # fmt: skip
    assert sampled != tok.encode(tok.decode(sampled, skip_special_tokens=False), add_special_tokens=False)
    obs = tok.encode(protocol.wrap("Doc 1(Title: a) a"), add_special_tokens=False)
    traj = _one_turn(prompt, sampled, obs)
    prompts = PromptDataset([{"prompt": "q", "golden_answers": ["a"]}], tok, 64).to_batch([0], uids=["u"])
    ok = check_round_trip([traj], trajectories_batch([traj], prompts, tok, {}), tok, protocol)
    assert ok["round_trip/noncanonical_turns"] == 1 and ok["round_trip/observations"] == 1
    canonical = tok.encode(tok.decode(sampled, skip_special_tokens=False), add_special_tokens=False)
    retokenised = _one_turn(prompt, canonical, obs)  # what a decode / re-encode pipeline would have trained
    with pytest.raises(RoundTripError, match="policy ids differ from the ids the engine sampled"):
        check_round_trip([traj], trajectories_batch([retokenised], prompts, tok, {}), tok, protocol)


class _MisframedToolCalls(ToolCallProtocol):
    """An environment bug: every observation gets a stray space after the template's frame."""

    def wrap(self, body: str) -> str:
        return super().wrap(body) + " "


@pytest.mark.parametrize("misframed", [False, True])
def test_the_streaming_rollout_checks_the_round_trip_too(misframed):
    # trainer.rollout_mode=streaming: each finished group's sample is checked as a batch's is; a mismatch fails the
    # run at the driver's next poll instead of being regenerated like an engine error
    cfg = _cfg("qwen2")
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, n=2, max_turns=3))
    tok = family_tokenizer("qwen2")
    protocol = _MisframedToolCalls() if misframed else protocol_for(cfg)
    rows = [{"prompt": protocol.build_prompt("is it so?", "instruct"), "golden_answers": ["yes"]}]
    group = PromptDataset(rows, tok, max_prompt_length=2048, protocol=protocol).to_batch([0], uids=["a"])
    group.meta_info.update(seed=3, **{SEQ: 0})
    engine = ScriptedHFEngine(load_model(cfg.model, tok, seed=0), tok, lambda ctx: CALLS["qwen2"].format(k=1))
    stream = TrajectoryStream(engine, tok, cfg, protocol, search=_search)
    try:
        stream.submit([group])
        if misframed:
            with pytest.raises(RoundTripError, match="chat template"):
                stream.poll(wait_s=60)
            return
        finished, _ = stream.poll(wait_s=60)
        assert len(finished) == 1 and list(finished[0].non_tensor_batch["n_searches"]) == [2, 2]  # checked: no raise
    finally:
        stream.close()
        engine.close()


SPLIT_CALL, SPLIT_ANSWER = CALLS["qwen2"].format(k="paris"), "<think> </think><answer> yes </answer>"


def _split(tok, text: str) -> list[int]:
    """One token per character: ids the tokenizer would merge (BPE encodes the text with fewer, other ids)."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]


class _SplitEngine(RolloutEngine):
    """An engine double sampling non-canonical splits: a tool call until the context holds a tool turn, then an
    answer."""

    def __init__(self, tok):
        self.tok = tok

    async def generate(self, prompt_ids, sampling, stop):
        searched = TOOL_TURN["qwen2"] in self.tok.decode(prompt_ids, skip_special_tokens=False)
        text = SPLIT_ANSWER if searched else SPLIT_CALL
        ids = _split(self.tok, text)[: sampling.max_tokens]
        end = next((s for s in stop if text.endswith(s)), None)
        return GenerationResult(ids, [-0.5] * len(ids), "stop" if end else "eos", end)

    def load_weights(self, weights, version=None):
        self.version = self.version + 1 if version is None else version


def _split_setup():
    """(cfg, tokenizer, protocol, prompts) of a chat-template tool-call run: one prompt, two samples."""
    cfg = _cfg("qwen2")
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, n=2, max_turns=3))
    tok, protocol = family_tokenizer("qwen2"), protocol_for(cfg)
    rows = [{"prompt": protocol.build_prompt("is it so?", "instruct"), "golden_answers": ["yes"]}]
    prompts = PromptDataset(rows, tok, max_prompt_length=2048, protocol=protocol).to_batch([0], uids=["a"])
    prompts.meta_info["seed"] = 3
    assert _split(tok, SPLIT_CALL) != tok.encode(SPLIT_CALL, add_special_tokens=False)  # really non-canonical
    return cfg, tok, protocol, prompts


def test_ids_trained_as_sampled_pass_and_every_token_is_counted():
    cfg, tok, protocol, prompts = _split_setup()
    batch = generate_batch(_SplitEngine(tok), tok, prompts, cfg, search=_search, protocol=protocol)
    metrics, nt = batch.meta_info["metrics"], batch.non_tensor_batch
    assert list(nt["n_searches"]) == [1, 1] and list(nt["finish_reason"]) == ["answer", "answer"]
    assert metrics["round_trip/trajectories"] == 2 and metrics["round_trip/rows"] == 2
    assert metrics["round_trip/tokens"] == int(batch.batch["attention_mask"].sum()) > 0  # every real token
    assert metrics["round_trip/noncanonical_turns"] == 4 and metrics["round_trip/observations"] == 2
    assert all(record is not None for record in nt[RECORD])  # carried to the driver


def test_a_retokenisation_between_the_engine_and_the_batch_fails_the_run(monkeypatch):
    """A step after the engine returns decodes the sampled ids and encodes the text again: the turn and the row both
    hold the re-encoded ids (comparing those two copies passes), the engine record kept its own copy: the run fails."""
    cfg, tok, protocol, prompts = _split_setup()
    original = agent_loop._generate_turn

    async def retokenising(engine, traj, *args):
        out = await original(engine, traj, *args)
        ids = tok.encode(tok.decode(out.token_ids, skip_special_tokens=False), add_special_tokens=False)
        return dataclasses.replace(out, token_ids=ids, logprobs=[-0.5] * len(ids))

    monkeypatch.setattr(agent_loop, "_generate_turn", retokenising)
    protocol.bind_tokenizer(tok, chat=True)
    prompt_ids = list(prompts.non_tensor_batch["prompt_ids"][0])
    run = agent_loop.run_trajectory(_SplitEngine(tok), tok, protocol, _search, prompt_ids, cfg, SamplingParams())
    traj = asyncio.run(run)
    first = traj.turns[0].policy_ids
    assert first != _split(tok, SPLIT_CALL) and traj.rows[0].response_ids[: len(first)] == first  # copies agree
    with pytest.raises(RoundTripError, match="turn 0: the trained policy ids differ from the ids the engine sampled"):
        check_round_trip([traj], trajectories_batch([traj], prompts, tok, {}), tok, protocol)
    with pytest.raises(RoundTripError, match="policy ids differ from the ids the engine sampled"):
        generate_batch(_SplitEngine(tok), tok, prompts, cfg, search=_search, protocol=protocol)


def test_a_context_rebuilt_from_text_fails_the_run(monkeypatch):
    """Each turn's context re-encoded from the text so far (instead of the ids): the engine samples after ids the row
    does not train; the record's digest of what the engine was handed catches it."""
    cfg, tok, protocol, prompts = _split_setup()
    rebuilt = property(lambda row: tok.encode(tok.decode(row.prompt_ids + row.response_ids, skip_special_tokens=False),
                                              add_special_tokens=False))  # fmt: skip
    monkeypatch.setattr(Row, "context_ids", rebuilt)
    with pytest.raises(RoundTripError, match="turn 1: the engine sampled after a context"):
        generate_batch(_SplitEngine(tok), tok, prompts, cfg, search=_search, protocol=protocol)


def test_the_driver_checks_the_tensors_the_update_gets():
    """The checked rows carry their record to the driver, which checks them again on the final batch: wider padding,
    another row order and copies (joins, fit_rows) pass with every token counted; ids re-encoded from text on the
    way, input_ids that are not prompts ‖ responses or shifted positions fail."""
    cfg, tok, protocol, prompts = _split_setup()
    batch = generate_batch(_SplitEngine(tok), tok, prompts, cfg, search=_search, protocol=protocol)
    joined = DataProto.concat([_widened(batch.select_idxs([1]), 3, 5), _widened(batch.select_idxs([0, 1]), 3, 5)])
    _, metrics = round_trip_phase(joined)
    real = int(batch.batch["attention_mask"].sum()) + int(batch.batch["attention_mask"][1].sum())
    assert metrics == {"round_trip/update_rows": 3.0, "round_trip/update_tokens": float(real)}
    retokenised = trajectories_batch([_retokenised(t, tok) for t in _trajectories(batch)], batch, tok, {})
    assert retokenised.non_tensor_batch[RECORD][0] is not None  # the record travelled; the ids were rebuilt
    with pytest.raises(RoundTripError, match="policy ids differ from the ids the engine sampled"):
        round_trip_phase(retokenised)
    shifted = joined.select_idxs([0, 1, 2])
    shifted.batch["input_ids"][2] = torch.roll(shifted.batch["input_ids"][2], 1)
    with pytest.raises(RoundTripError, match="row 2 .*input_ids"):
        check_batch_records(shifted)
    moved = joined.select_idxs([0, 1, 2])
    moved.batch["position_ids"][1] += 1
    with pytest.raises(RoundTripError, match="row 1 .*position ids"):
        check_batch_records(moved)


def _widened(batch: DataProto, left: int, right: int) -> DataProto:
    """The batch with `left` more prompt padding columns and `right` more response ones (what a join may add)."""
    t, p = batch.batch, batch.batch["prompts"].shape[1]
    attn = torch.cat([F.pad(t["attention_mask"][:, :p], (left, 0)), F.pad(t["attention_mask"][:, p:], (0, right))], 1)
    tensors = sequence_keys(F.pad(t["prompts"], (left, 0)), F.pad(t["responses"], (0, right)), attn,
                            F.pad(t["response_mask"], (0, right)))  # fmt: skip
    return DataProto.from_dict(tensors=tensors, non_tensors=dict(batch.non_tensor_batch))


def _retokenised(traj: Trajectory, tok) -> Trajectory:
    """The trajectory with each policy turn decoded and encoded again (what a pipeline through text trains)."""
    out = Trajectory(list(traj.prompt_ids))
    for turn in traj.turns:
        ids = tok.encode(tok.decode(turn.policy_ids, skip_special_tokens=False), add_special_tokens=False)
        out.add(ids, 1, None, "policy", "")
        out.add(turn.obs_ids, 0, None, "observation", "")
    return out


def test_the_switch():
    base = ["+recipe=search_r1_toolcall_grpo"]
    assert not round_trip_enabled(load_config(base))  # base prompts: no template to re-render
    assert round_trip_enabled(load_config([*base, "model=tiny_llama3"]))  # chat template: on by default
    assert not round_trip_enabled(load_config([*base, "model=tiny_llama3", "rollout.round_trip_check=off"]))
    assert round_trip_enabled(load_config([*base, "rollout.round_trip_check=on"]))
    assert ModelConfig().family is None


def _one_turn(prompt: list[int], policy: list[int], obs: list[int]) -> Trajectory:
    traj = Trajectory(list(prompt))
    traj.add(policy, 1, [0.0] * len(policy), "policy", "call")
    traj.add(obs, 0, None, "observation", "obs")
    traj.turns.append(Turn(list(policy), list(obs)))
    return _recorded(traj)


def _recorded(traj: Trajectory) -> Trajectory:
    """A hand-built one-row trajectory with the engine record its turns would have left (rollout/round_trip.py)."""
    context = list(traj.prompt_ids)
    for turn in traj.turns:
        traj.record.context(0, context)
        traj.record.sampled(0, turn.policy_ids)
        if turn.obs_ids:
            traj.record.inserted(0, turn.obs_ids)
        context += turn.policy_ids + turn.obs_ids
    return traj


def _trajectories(batch) -> list[Trajectory]:
    """The batch's trajectories rebuilt from its rows and recorded segments' token runs (one row each)."""
    out = []
    t = batch.batch
    for i in range(len(batch)):
        p = t["prompts"].shape[1]
        att = t["attention_mask"][i].tolist()
        prompt = [x for x, a in zip(t["prompts"][i].tolist(), att[:p], strict=True) if a]
        n = sum(att[p:])
        ids, mask = t["responses"][i, :n].tolist(), t["response_mask"][i, :n].tolist()
        traj, start = Trajectory(prompt), 0
        while start < n:
            end = start
            while end < n and mask[end] == 1:
                end += 1
            obs_end = end
            while obs_end < n and mask[obs_end] == 0:
                obs_end += 1
            traj.add(ids[start:obs_end], 1, None, "policy", "")
            traj.turns.append(Turn(ids[start:end], ids[end:obs_end]))
            start = obs_end
        traj.rows[0].response_mask = mask
        out.append(_recorded(traj))
    return out


def _with_obs(traj: Trajectory, replace: dict[int, list[int]]) -> Trajectory:
    turns = [Turn(t.policy_ids, replace.get(k, t.obs_ids)) for k, t in enumerate(traj.turns)]
    out = Trajectory(list(traj.prompt_ids))
    for turn in turns:
        out.add(turn.policy_ids, 1, None, "policy", "")
        if turn.obs_ids:
            out.add(turn.obs_ids, 0, None, "observation", "")
    out.turns = turns
    return _recorded(out)


def _batch(trajs: list[Trajectory], like, tok):
    return trajectories_batch(trajs, like.select_idxs(list(range(len(trajs)))), tok, {})
