"""The SFT stage: observation tokens carry no loss, training lowers the loss on real toy-world demonstrations, and the
toy world's warm start is built once and reused from its cache."""

import os

import torch

from rsearch_verl.config import load_config
from rsearch_verl.models import load_model, load_tokenizer
from rsearch_verl.sft import SFTOptions, _collate, sft_loss, tokenize_demo, toy_demos, train_sft, warm_start
from rsearch_verl.trainer.session import toy_world_data

SMALL = [
    "model.sft_checkpoint=null",
    "data.toy_world.n_entities=24",
    "data.toy_world.n_train=24",
    "data.toy_world.n_val=4",
]


def _cfg(tmp_path):
    cfg = load_config(["+recipe=search_r1_ppo", *SMALL, f"data.toy_world.cache_dir={tmp_path}"])
    cfg.model.tokenizer_path = toy_world_data(cfg).tokenizer_path
    return cfg


def test_observation_tokens_have_no_loss(tmp_path):
    cfg = _cfg(tmp_path)
    tok = load_tokenizer(cfg.model)
    segments = [("policy", "<search> x </search>"), ("observation", "<information> doc </information>")]
    segments.append(("policy", "<answer> y </answer>"))
    ids, mask = tokenize_demo(tok, "Question: q?", segments, max_length=512)
    n_prompt = len(tok("Question: q?", add_special_tokens=False)["input_ids"])
    obs = tok("<information> doc </information>", add_special_tokens=False)["input_ids"]
    first = tok("<search> x </search>", add_special_tokens=False)["input_ids"]
    start = n_prompt + len(first)
    assert mask[:n_prompt] == [0] * n_prompt and mask[n_prompt:start] == [1] * len(first)
    assert mask[start : start + len(obs)] == [0] * len(obs) and ids[start : start + len(obs)] == obs
    assert mask[-1] == 1 and ids[-1] == tok.eos_token_id

    # with every target masked there is nothing to learn: zero loss
    model = load_model(cfg.model, tok, seed=0)
    batch = _collate([(ids, mask)], tok.pad_token_id)
    batch["loss_mask"][:] = 0  # no target at all -> zero loss and zero gradient
    assert float(sft_loss(model, batch)) == 0.0


def test_sft_lowers_loss_and_warm_start_is_cached(tmp_path):
    cfg = _cfg(tmp_path)
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, seed=0)
    demos = toy_demos(cfg, n=16)
    assert all(role in ("policy", "observation") for d in demos for role, _ in d["segments"])
    history = train_sft(model, tok, demos, SFTOptions(epochs=5, lr=3e-3, batch_size=4))
    assert history[-1] < history[0] * 0.75, history

    opts = SFTOptions(epochs=1, copy_epochs=1, batch_size=8, n_demos=32)  # the curriculum: search demos, then the mix
    assert sum(d["searched"] for d in toy_demos(cfg, n=32, p_no_search=0.0, seed=1)) == 32
    path = warm_start(cfg, opts)
    assert os.path.isfile(os.path.join(path, "config.json"))
    stamp = os.path.getmtime(os.path.join(path, "config.json"))
    assert warm_start(cfg, opts) == path and os.path.getmtime(os.path.join(path, "config.json")) == stamp
    cfg.model.sft_checkpoint = path
    reloaded = load_model(cfg.model, tok)
    assert isinstance(next(reloaded.parameters()), torch.Tensor)
