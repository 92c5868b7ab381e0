"""The warm start's cache key names what shapes the warm start, not where the cache lies: a copied ~/.cache, another
$HOME or another data.toy_world.cache_dir root finds the same warm start, and warm_start.sft fields every phase
overwrites do not move it; a field the warm start reads does.

    .venv/bin/python -m pytest -q tests/toy/test_warm_start_key.py
"""

from __future__ import annotations

import pytest

from rsearch_verl.config import load_config
from rsearch_verl.toy.warm_start import cache_key

RECIPE = "+recipe=search_r1_ppo"


def _key(*overrides: str) -> str:
    return cache_key(load_config([RECIPE, *overrides]))


def test_the_key_is_the_same_under_another_home(monkeypatch):
    monkeypatch.setenv("HOME", "/a")
    at_a = _key()
    monkeypatch.setenv("HOME", "/b")
    assert _key() == at_a


def test_the_key_is_the_same_under_another_cache_root(tmp_path):
    one = _key(f"data.toy_world.cache_dir={tmp_path / 'one' / 'toy_world'}")
    assert _key(f"data.toy_world.cache_dir={tmp_path / 'two' / 'elsewhere'}") == one == _key()


@pytest.mark.parametrize("field", ["epochs=7", "lr=0.5", "seed=9", "schedule=constant"])
def test_overwritten_sft_fields_stay_out_of_the_key(field):
    assert _key(f"warm_start.sft.{field}") == _key()


@pytest.mark.parametrize(
    "override",
    [
        "model.warm_start_seed=1",
        "data.toy_world.seed=1",
        "data.toy_world.n_entities=256",
        "rollout.protocol=tool_call",
        "retriever.topk=2",
        "warm_start.copy_lr=1e-3",
        "warm_start.n_demos=512",
        "warm_start.sft.batch_size=4",
        "warm_start.sft.max_length=512",
        "model.tiny.num_hidden_layers=2",
    ],
)
def test_a_field_the_warm_start_reads_moves_the_key(override):
    assert _key(override) != _key()


def test_the_rl_seed_shares_one_warm_start():
    assert _key("seed=7") == _key()


def test_how_a_recipe_folds_moves_the_key_only_when_it_folds():
    # folded demonstrations (rsearch_verl/toy/fold_demos.py) are rows cut where the rollout folds: the strategy and
    # the budgets decide them; a recipe that does not fold keeps its key whatever those budgets are
    deep = cache_key(load_config(["+recipe=deep_search_grpo"]))
    summary = cache_key(load_config(["+recipe=deep_search_grpo", "rollout.context.strategy=summary"]))
    wider = cache_key(load_config(["+recipe=deep_search_grpo", "rollout.max_response_length=256"]))
    assert len({deep, summary, wider}) == 3
    assert _key("rollout.max_response_length=256") == _key() == _key("rollout.context.keep_recent_turns=3")


def test_model_fields_added_later_move_the_key_only_when_set():
    # model.family / model.thinking came after warm starts were cached: unset, they leave every key as it was
    assert _key("model.family=qwen2") != _key()
    assert _key("model.use_chat_template=true", "model.thinking=false") != _key("model.use_chat_template=true")
    assert _key() == "bab5423a80fc"  # the README job's key (+recipe=search_r1_ppo, no tokenizer applied) since before
