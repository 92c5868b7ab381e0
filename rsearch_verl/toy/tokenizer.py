"""The toy world's own tokenizer: a small byte-level BPE for the tiny Qwen2 policy, trained on the world's corpus and
questions and on the protocols' prompts, tags and observation text, with the protocols' special tokens.

It sits above both the world (rsearch_verl/toy/world.py) and its demonstrations (rsearch_verl/toy/demos.py,
whose text sharpens the merges), so neither of those imports it.

Usage:
    world = build_toy_world(cfg.data.toy_world)
    tok_dir = toy_tokenizer(world, ["search_r1"])   # cached under the world's directory; an HF tokenizer dir
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import tempfile

from rsearch_verl.choices import PROMPT_VARIANTS
from rsearch_verl.config import ToyWorldConfig
from rsearch_verl.log_setup import setup_logging
from rsearch_verl.models import train_bpe_tokenizer
from rsearch_verl.publish import publish_dir
from rsearch_verl.rollout.protocols import get_protocol
from rsearch_verl.search.types import Doc
from rsearch_verl.toy.demos import demonstrations
from rsearch_verl.toy.world import GENERATOR_VERSION, World, build_toy_world

logger = logging.getLogger(__name__)

TOKENIZER_VOCAB = 3072


def _passage_format(proto) -> str:
    """How `proto` writes one retrieved passage ("" for protocols without a passage list)."""
    fmt = getattr(proto, "format_docs", None)
    return fmt([Doc("d", '"T"\nbody')]) if fmt else ""


def toy_tokenizer(world: World, protocols: list[str], vocab_size: int = TOKENIZER_VOCAB) -> str:
    """A small byte-level BPE tokenizer for the tiny policy, trained on the corpus, the questions and each
    protocol's prompt / tag / observation text, with the protocols' special tokens; cached; returns its dir.

    Every word of every name is one token, with and without a leading space (the word pools are small and shared
    by both sides, see `name_pools`): copying a held-out name is copying tokens seen in training. Checked here.
    """
    names = sorted(set(protocols))
    # the protocols' templates, special tokens and passage format are part of the key: editing them retrains it
    fingerprint = [(n, get_protocol(n).special_tokens, get_protocol(n).build_prompt("Q?", "base")) for n in names]
    fingerprint += [_passage_format(get_protocol(n)) for n in names]
    key = hashlib.sha1(json.dumps([fingerprint, vocab_size, GENERATOR_VERSION]).encode()).hexdigest()[:10]
    out = os.path.join(world.root, f"tokenizer_{key}")
    if os.path.exists(os.path.join(out, "tokenizer_config.json")):
        return out
    questions = world.questions("train") + world.questions("val")
    texts = list(world.passages().values()) + [q["question"] for q in questions]
    words = sorted({w for e in world.entities for w in e.name.split()})
    texts += [" ".join(words)] * 64 + ["\n".join(words)] * 64  # each word, spaced and not, merged to one token
    specials: list[str] = []
    for name in names:
        proto = get_protocol(name)
        specials += [t for t in proto.special_tokens if t not in specials]
        for q in questions[:16]:
            for variant in PROMPT_VARIANTS:
                prompt = proto.build_prompt(q["question"], variant)
                texts.append(prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt))
        try:
            texts += ["".join(t for _, t in d["segments"]) for d in demonstrations(world, name, n=32, seed=0)]
        except ValueError as exc:  # demos only sharpen merges; the byte-level tokenizer still covers everything
            logger.warning("toy tokenizer: no demonstrations for %s (%s)", name, exc)
    tok = train_bpe_tokenizer(texts, vocab_size=vocab_size, extra_special=specials)
    split = [w for w in words if len(tok.tokenize(" " + w)) != 1 or len(tok.tokenize(w)) != 1]
    if split:
        raise ValueError(f"toy tokenizer: names split into pieces {split[:5]}; raise the vocabulary size")
    tmp = tempfile.mkdtemp(prefix=".tok-", dir=world.root)
    try:
        tok.save_pretrained(tmp)
        publish_dir(tmp, out, marker="tokenizer_config.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("toy world: tokenizer with %d tokens for %s at %s", len(tok), names, out)
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m rsearch_verl.toy.tokenizer --protocols search_r1,tool_call [--seed 0] [--cache-dir DIR]`:
    build (or find) the default-sized world's tokenizer and print its directory."""

    defaults = ToyWorldConfig()
    parser = argparse.ArgumentParser(description="Build (or find) the toy world's tokenizer and print where it is.")
    parser.add_argument("--protocols", default="search_r1", help="comma-separated protocol names")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--cache-dir", default=defaults.cache_dir)
    args = parser.parse_args(argv)
    setup_logging()
    world = build_toy_world(ToyWorldConfig(seed=args.seed, cache_dir=args.cache_dir))
    print(f"tokenizer\t{toy_tokenizer(world, args.protocols.split(','))}")  # noqa: T201 - the CLI's output


if __name__ == "__main__":
    main()
