"""The deep toy world (data=toy_world_deep, +recipe=deep_search_grpo): 4-6 hop chains whose answers follow the
facts, searching trajectories that pass the tiny policy's 512 positions for at least a third of the questions when
nothing folds, and a warm start whose demonstrations are folded as the rollout folds (rsearch_verl/toy/fold_demos.py).

Run: .venv/bin/python -m pytest -q tests/toy/test_toy_world_deep.py
"""

from __future__ import annotations

import collections

import pytest
from transformers import AutoTokenizer

from rsearch_verl.config import load_config
from rsearch_verl.rollout.context import NOTE_CLOSE, NOTE_OPEN
from rsearch_verl.rollout.protocols import protocol_for
from rsearch_verl.sft import tokenize_demo
from rsearch_verl.toy.demos import demonstrations, hop_notes
from rsearch_verl.toy.entities import PHRASE, fact_key, fact_sentence
from rsearch_verl.toy.tokenizer import toy_tokenizer
from rsearch_verl.toy.warm_start import toy_demos
from rsearch_verl.toy.world import build_toy_world


@pytest.fixture(scope="module")
def deep():
    cfg = load_config(["+recipe=deep_search_grpo"])
    world = build_toy_world(cfg.data.toy_world)
    tok = AutoTokenizer.from_pretrained(toy_tokenizer(world, [cfg.rollout.protocol]))
    return cfg, world, tok


def test_chains_of_four_to_six_hops_follow_the_facts(deep):
    cfg, world, _ = deep
    by_name, passages = world.by_name(), world.passages()
    for split in ("train", "val"):
        hops = collections.Counter(q["hops"] for q in world.questions(split))
        assert sum(hops[h] for h in (4, 5, 6)) >= 0.5 * sum(hops.values()) and all(hops[h] for h in (4, 5, 6))
    for q in world.questions("val"):
        assert len(q["support"]) == q["hops"] == len(q["path"])
        subject = q["entities"][0]
        for attr, pid in zip(q["path"], q["support"], strict=True):
            assert pid in passages and by_name[subject].side == "val"
            subject = by_name[subject].attrs[attr]
        assert subject == q["golden_answers"][0]


def test_a_third_of_searching_trajectories_pass_the_context_unfolded(deep):
    cfg, world, tok = deep
    demos = demonstrations(world, cfg.rollout.protocol, 300, seed=3, p_no_search=0.0, topk=cfg.retriever.topk)
    lengths = [len(tokenize_demo(tok, d["prompt"], d["segments"], 1 << 20)[0]) for d in demos]
    positions = cfg.model.tiny.max_position_embeddings
    assert sum(n > positions for n in lengths) >= len(lengths) / 3


@pytest.mark.parametrize("strategy", ["drop_observations", "summary"])
def test_warm_start_demonstrations_are_folded_rows(deep, strategy):
    cfg, _, tok = deep
    cfg = load_config(["+recipe=deep_search_grpo", f"rollout.context.strategy={strategy}"])
    demos = toy_demos(cfg, 48, 0.0, 1, tok, protocol_for(cfg))
    rows = [d for d in demos if "ids" in d]
    assert rows and any(d["row"] > 0 for d in rows)  # long chains fold
    for d in rows:
        assert len(d["ids"]) == len(d["weights"]) <= cfg.model.tiny.max_position_embeddings
        assert d["weights"][0] == 0.0 and 1.0 in d["weights"]  # the context is not trained; the policy's text is
        trained = tok.decode([t for t, w in zip(d["ids"], d["weights"], strict=True) if w > 0])
        assert "<information>" not in trained  # observations (and markers) are never targets
    last = [d for d in rows if d["ids"][-1] == tok.eos_token_id]
    assert len(last) == len({d["question"] for d in rows})  # one EOS per demonstration, after its answer
    if strategy == "summary":
        folded = [d for d in rows if d["row"] > 0]
        assert all(NOTE_OPEN in tok.decode(d["ids"]) for d in folded)
        earlier = [d for d in rows if d["ids"][-1] != tok.eos_token_id]
        assert all(tok.decode(d["ids"]).rstrip().endswith(NOTE_CLOSE) for d in earlier)  # a row ends with its note
        for d in earlier:  # a note states only what this row's context retrieved: never the next hop's answer
            context = tok.decode([t for t, w in zip(d["ids"], d["weights"], strict=True) if w == 0])
            note = tok.decode(d["ids"]).rsplit(NOTE_OPEN, 1)[1]
            found = note.split(" Left:")[0].strip()
            assert not found or found.split(" is ", 1)[1].rstrip(".") in context.rsplit(NOTE_OPEN, 1)[0]


def test_summary_notes_are_the_newest_fact_and_the_chain_left(deep):
    _, world, _ = deep
    for q in world.questions("val")[:64]:
        notes, chain = hop_notes(q), q["entities"] + q["golden_answers"][:1]
        assert len(notes) == q["hops"] + 1 and notes[-1].endswith("Left: nothing.")
        assert notes[0].startswith("Left: ") and notes[0].endswith(f"{fact_key(q['path'][0], chain[0])}.")
        assert notes[0].count(" of ") == q["hops"] and all(PHRASE[attr] in notes[0] for attr in q["path"])
        for k in range(1, q["hops"] + 1):  # the fact found at hop k-1, then the rest around its value
            assert notes[k].startswith(fact_sentence(q["path"][k - 1], chain[k - 1], chain[k]) + " Left: ")
            if k < q["hops"]:  # the innermost link is the next search
                assert notes[k].endswith(f"{fact_key(q['path'][k], chain[k])}.")
        assert all(len(notes[k + 1]) <= len(notes[k]) + 8 for k in range(1, q["hops"]))  # short at any depth


def test_a_world_too_small_for_its_twins_says_so(tmp_path):
    cfg = load_config(
        ["+recipe=deep_search_grpo", "data.toy_world.n_entities=48", "data.toy_world.n_train=64",
         "data.toy_world.n_val=8", f"data.toy_world.cache_dir={tmp_path}"]
    )  # fmt: skip
    with pytest.raises(ValueError, match="toy_world.n_entities"):
        build_toy_world(cfg.data.toy_world)
