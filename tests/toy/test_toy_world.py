"""The toy world: deterministic, cached, entity-disjoint train / val split, answers findable in the corpus."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from rsearch_verl.config import ToyWorldConfig
from rsearch_verl.testing.worlds import mentions, side_leaks
from rsearch_verl.toy.entities import COLOURS, PROFESSIONS
from rsearch_verl.toy.world import build_toy_world, generate, world_hash

KINDS = ("person", "city", "region")


def _files(world) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(world.root)):
        with open(os.path.join(world.root, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_toy_world(ToyWorldConfig(cache_dir=str(tmp_path_factory.mktemp("tw"))))


# The default world (seed 0) as generator v3 built it before the harder worlds' knobs existed (sha256 of each file) and
# its cache hash: cached worlds, their tokenizers and the warm starts are keyed by these, so they must not move.
DEFAULT_WORLD_SHA256 = {
    "corpus.jsonl": "62eea54f299a8b9a43187fbb186db8f950e666fb98fb03d5e6db0c42d45551fa",
    "entities.json": "4729d389bd058c8e7defcabbbbbdda82cc223883e17f691a89e0032afbebfc4c",
    "train.jsonl": "9d77ed2179c3f8e927313f8fd13d94cf6982718149404d78399883fbd730892e",
    "val.jsonl": "bf0ac6eb68b50e70077b6128a423b846645f0d584fb43a664c4074b9bc507919",
    "world.json": "e9184270db6e0ddc7f90690899ccf4857d9cae0fc104df3bb2427dfce9e96722",
}


def test_the_default_world_is_byte_for_byte_what_it_was(world):
    from rsearch_verl.toy.world import world_fields

    assert {name: hashlib.sha256(data).hexdigest() for name, data in _files(world).items()} == DEFAULT_WORLD_SHA256
    assert os.path.basename(world.root) == world_hash(ToyWorldConfig()) == "b0f945b2a70f"
    assert world_hash(ToyWorldConfig(seed=1)) == "49cf2ebca28c"
    # knobs at their defaults stay out of every cache key, and so does where the cache lies
    assert set(world_fields(ToyWorldConfig())) == {"seed", "n_entities", "n_train", "n_val"}


def test_deterministic_for_a_seed(tmp_path):
    a = build_toy_world(ToyWorldConfig(seed=3, cache_dir=str(tmp_path / "a")))
    b = build_toy_world(ToyWorldConfig(seed=3, cache_dir=str(tmp_path / "b")))
    assert _files(a) == _files(b)
    c = generate(ToyWorldConfig(seed=4))
    assert [e.name for e in c[0]] != [e.name for e in a.entities]


def test_default_sizes(world):
    assert len(world.entities) == 320
    assert len(world.questions("train")) == 512 and len(world.questions("val")) == 64
    for split in ("train", "val"):
        qs = world.questions(split)
        assert len({q["id"] for q in qs}) == len(qs)
        assert {q["data_source"] for q in qs} == {"toy_world_1hop", "toy_world_2hop"}
        two = sum(q["hops"] == 2 for q in qs)
        assert two == len(qs) // 2 if split == "val" else len(qs) // 3 <= two <= len(qs) // 2
        assert len({q["question"] for q in qs}) == len(qs)


def test_names_are_made_up_unique_and_spelt_from_shared_words(world):
    names = [e.name for e in world.entities]
    assert len(set(names)) == len(names)
    assert all(len(n.split()) == 2 for n in names)
    words = {kind: {w for e in world.entities if e.kind == kind for w in e.name.split()} for kind in KINDS}
    for a in KINDS:  # a word says what kind of thing it names
        assert all(not words[a] & words[b] for b in KINDS if b != a)
    common = set(PROFESSIONS) | set(COLOURS) | {"the", "city", "region", "mentor"}
    assert not {w.lower() for ws in words.values() for w in ws} & common
    # every word of a held-out name also names training entities: the policy copies, it never has to invent
    for kind in KINDS:
        train = {w for e in world.entities if e.kind == kind and e.side == "train" for w in e.name.split()}
        val = {w for e in world.entities if e.kind == kind and e.side == "val" for w in e.name.split()}
        assert val <= train, (kind, val - train)


def test_val_entities_never_in_train_questions(world):
    assert side_leaks(world) == []


def test_every_answer_is_in_the_hop_passages(world):
    passages = world.passages()
    assert len(passages) == sum(len(e.attrs) for e in world.entities)  # one passage per fact
    assert sorted(passages) == sorted(pid for e in world.entities for pid in e.passage_ids.values())
    for q in world.questions("train") + world.questions("val"):
        chain = [passages[pid] for pid in q["support"]]
        assert len(chain) == q["hops"]
        assert chain[0].startswith(f'"{q["entities"][0]}"\n')  # hop 1: a fact of the subject ...
        if q["hops"] == 2:
            assert chain[0].endswith(f" is {q['entities'][1]}.")  # ... naming the bridge entity ...
            assert chain[1].startswith(f'"{q["entities"][1]}"\n')  # ... whose fact holds the answer
        assert chain[-1].endswith(f" is {q['golden_answers'][0]}.")
        assert len(chain[-1].splitlines()) == 2 and chain[-1].count(" is ") == 1  # title, one sentence
    with open(world.corpus_path) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        assert set(row) == {"id", "contents"} and row["contents"].startswith('"')


def test_cache_reuse_and_leftovers(tmp_path):
    cfg = ToyWorldConfig(seed=5, cache_dir=str(tmp_path))
    first = build_toy_world(cfg)
    assert os.path.basename(first.root) == world_hash(cfg)
    stamp = os.stat(first.corpus_path).st_mtime_ns
    again = build_toy_world(ToyWorldConfig(seed=5, cache_dir=str(tmp_path)))
    assert again.root == first.root and os.stat(again.corpus_path).st_mtime_ns == stamp
    assert [e.name for e in again.entities] == [e.name for e in first.entities]
    # a world killed before its manifest was written is never reused
    os.remove(os.path.join(first.root, "world.json"))
    open(first.corpus_path, "w").close()
    rebuilt = build_toy_world(cfg)
    assert os.path.getsize(rebuilt.corpus_path) > 0 and not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    assert world_hash(ToyWorldConfig(seed=5, cache_dir="/elsewhere")) == world_hash(cfg)
    assert world_hash(ToyWorldConfig(seed=5, n_val=10)) != world_hash(cfg)


def test_bad_sizes_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="n_entities"):
        build_toy_world(ToyWorldConfig(n_entities=60, n_train=5000, cache_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="n_entities"):
        build_toy_world(ToyWorldConfig(n_entities=5, cache_dir=str(tmp_path)))


DEMO_PROTOCOLS = ["search_r1", "research", "r1_searcher", "r_search", "nl_dag", "tool_call"]


@pytest.mark.parametrize("protocol", DEMO_PROTOCOLS)
def test_demonstrations_follow_the_protocol(world, protocol):
    from rsearch_verl.rollout.protocols import get_protocol
    from rsearch_verl.toy.demos import demonstrations

    proto = get_protocol(protocol)
    demos = demonstrations(world, protocol, n=40, seed=1, p_no_search=0.5)
    assert demos == demonstrations(world, protocol, n=40, seed=1, p_no_search=0.5)
    val_names = [e.name for e in world.entities if e.side == "val"]
    searched = [d for d in demos if d["searched"]]
    assert 8 <= len(searched) <= 32
    assert len({d["question"] for d in demos}) >= 36  # practice facts, hardly ever repeated: nothing to memorise
    for d in demos:
        text = d["prompt"] + "".join(t for _, t in d["segments"])
        assert not [n for n in val_names if mentions(text, n)]  # a held-out entity is never demonstrated
        assert d["prompt"] == proto.build_prompt(d["question"], "base")
        roles = [role for role, _ in d["segments"]]
        assert roles[0] == roles[-1] == "policy" and set(roles) <= {"policy", "observation", "answer", "guess"}
        assert ("observation", "observation") not in zip(roles, roles[1:], strict=False)  # never two in a row
        # the final answer's value is a segment of its own: a target when searched, context when guessed
        assert roles[-3:] == ["policy", "answer" if d["searched"] else "guess", "policy"]
        text = "".join(t for _, t in d["segments"])
        assert proto.extract_answer(text).strip() == d["answer"]
        if d["searched"]:
            observations = [t for role, t in d["segments"] if role == "observation"]
            two_hop = "the birthplace of" in d["question"] or " where " in d["question"]
            assert len(observations) == (2 if two_hop else 1)
            assert mentions(observations[-1], d["answer"])  # the retrieved passage really holds the answer
            for obs in observations:
                assert obs.strip().startswith(proto.observation_open)
        else:
            assert roles == ["policy", "guess", "policy"]
    assert all(d["searched"] for d in demonstrations(world, protocol, n=10, seed=2, p_no_search=0.0))
    assert not any(d["searched"] for d in demonstrations(world, protocol, n=10, seed=2, p_no_search=1.0))


def test_toy_tokenizer_is_cached_and_gives_each_name_word_one_token(world):
    from rsearch_verl.config import ModelConfig
    from rsearch_verl.models import load_tokenizer
    from rsearch_verl.rollout.protocols import get_protocol
    from rsearch_verl.toy.tokenizer import toy_tokenizer

    path = toy_tokenizer(world, ["search_r1", "r1_searcher"])
    stamp = os.stat(os.path.join(path, "tokenizer_config.json")).st_mtime_ns
    assert toy_tokenizer(world, ["r1_searcher", "search_r1"]) == path
    assert os.stat(os.path.join(path, "tokenizer_config.json")).st_mtime_ns == stamp
    tok = load_tokenizer(ModelConfig(tokenizer_path=path))
    assert 500 < len(tok) <= 4096
    for special in get_protocol("r1_searcher").special_tokens:
        assert tok.tokenize(special) == [special]
    # every word of every name is one token, after a space (in text) and after a quote (in titles)
    for e in world.entities:
        for word in e.name.split():
            assert len(tok.tokenize(" " + word)) == 1 and len(tok.tokenize(word)) == 1, word
        assert len(tok.tokenize(f'(Title: "{e.name}")')) == len(tok.tokenize('(Title: "")')) + 2
    text = world.passages()[world.entities[-1].passage_ids["colour"]] + " <search> Vrasor </search> 1843 ¿ü"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_cli_prints_the_world(tmp_path, capsys):
    from rsearch_verl.toy.world import main

    main(["--seed", "2", "--cache-dir", str(tmp_path), "--n-train", "20", "--n-val", "8"])
    out = dict(line.split("\t", 1) for line in capsys.readouterr().out.splitlines() if "\t" in line)
    assert os.path.isfile(out["corpus"]) and os.path.isfile(out["val"])
    assert sum(1 for _ in open(out["train"])) == 20  # noqa: SIM115


def test_searching_each_hop_fact_finds_its_passage(world):
    """With the retrieval server's BM25 index (bm25s, its stop words and k1 / b) the query 'the region of Tul Vex'
    (what the demonstrations search) returns that hop's fact first for every question: the answers are findable
    by searching, and other facts that name the same entity, or share a name word, rank below it."""
    from retrieval_server.bm25 import BM25Index
    from rsearch_verl.toy.demos import question_attrs
    from rsearch_verl.toy.entities import fact_key

    passages = world.passages()
    ids = list(passages)
    index = BM25Index.build([[passages[i] for i in ids]])
    questions = world.questions("train") + world.questions("val")
    hops = [
        (fact_key(question_attrs(q)[h], q["entities"][h]), q["support"][h]) for q in questions for h in range(q["hops"])
    ]
    _, found = index.search([key for key, _ in hops], k=1)
    assert [ids[int(row[0])] for row in found] == [pid for _, pid in hops]
