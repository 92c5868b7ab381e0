"""Fixtures of the end-to-end tests (helpers are in e2e_helpers.py)."""

import pytest
from e2e_helpers import FAST, TINY


@pytest.fixture(scope="session")
def toy_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("toy_world"))


@pytest.fixture(scope="session")
def searching_policy(toy_cache, tmp_path_factory) -> str:
    """The tiny policy after a short SFT (~40 s on 2 busy cores) on the first turn of toy world demonstrations that
    always search (`<search> the birthplace of X </search>`): an HF dir for model.sft_checkpoint."""
    import torch

    from rsearch_verl.config import SFTConfig, load_config
    from rsearch_verl.run_context import RunContext
    from rsearch_verl.sft import load_policy, save_hf, train_sft
    from rsearch_verl.toy.tokenizer import toy_tokenizer
    from rsearch_verl.toy.warm_start import toy_demos
    from rsearch_verl.toy.world import build_toy_world

    cfg = load_config(["+recipe=search_r1_grpo", *TINY, *FAST, f"data.toy_world.cache_dir={toy_cache}"])
    tok_dir = toy_tokenizer(build_toy_world(cfg.data.toy_world), [cfg.rollout.protocol])
    cfg = RunContext(tokenizer_path=tok_dir).apply(cfg)
    model, tokenizer = load_policy(cfg, seed=0)
    demos = []
    for demo in toy_demos(cfg, n=32, p_no_search=0.0, seed=1):
        first = demo["segments"][0][1]
        demos.append({"prompt": demo["prompt"], "segments": [("policy", first[first.index("<search>") :])]})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two shared cores were ~10x slower here
    try:
        train_sft(model, tokenizer, demos, SFTConfig(epochs=10, lr=3e-3, warmup_steps=2, schedule="constant"))
    finally:
        torch.set_num_threads(threads)
    return save_hf(model, tokenizer, str(tmp_path_factory.mktemp("policy") / "searching"))
