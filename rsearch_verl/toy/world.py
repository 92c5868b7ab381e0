"""The embedded toy world: a seeded, fictional knowledge base whose questions can only be answered by searching.

People, cities and regions get made-up two-word names (never real words; each word comes from a pool of its kind,
so "Kiro Baz" is a person and "Tul Vex" a city); people have a birthplace, a birth year, a profession, a favourite
colour and usually a mentor; cities lie in a region and have a founding year; regions have an emblem animal. Each
fact becomes one short passage of the corpus, titled by its entity (`{"id", "contents": "\"Kiro Baz\"\nThe
profession of Kiro Baz is weaver."}`, the FlashRAG / Search-R1 format), so a search for "the profession of Kiro
Baz" returns exactly the fact. Questions need 1 hop ("What is the profession of Kiro Baz?") or 2 hops ("In which
region is the birthplace of Kiro Baz located?": search the person's birthplace, read the city, search the city's
region, read the region). One fact per passage keeps the reading easy for a 3-layer policy: with one passage per
entity (generator v2) the warm start restated the wrong attribute of the passage most of the time.

The entities are partitioned into two disconnected sub-worlds, train and val, and every question (its subject,
the entities on its hop chain and its answer) comes from one side only: validation answers cannot be memorised
from training questions, only found in the corpus. Attribute values (colours, professions, years) and name words
are shared; full names never are.

Harder worlds (`data=toy_world_hard`: 3-hop questions, near-twin distractors, passages of several sentences, questions
worded unlike the passages) come from rsearch_verl/toy/world_hard.py, which `generate` hands over to when the
config's knobs ask for it; the entities and the fact phrasing both generators use are rsearch_verl/toy/entities.py.

Files, cached under `cfg.cache_dir/<hash of the ToyWorldConfig>/` (built in a temp dir and renamed, so a half
written world is never reused): `corpus.jsonl`, `train.jsonl`, `val.jsonl` (`{"id", "question",
"golden_answers", "data_source": "toy_world_1hop" | "toy_world_2hop" (| "toy_world_3hop"), "hops", "entities",
"support"}`; `support` lists the passage ids of the hop chain; a harder world adds `path`, the attribute asked at each
hop), `entities.json`, `world.json` (written last = complete).

Usage:
    world = build_toy_world(cfg.data.toy_world)        # -> World(root, corpus_path, train_path, val_path, ...)
    tok_dir = toy_tokenizer(world, ["search_r1"])      # rsearch_verl/toy/tokenizer.py: for the tiny policy
    demos = demonstrations(world, "search_r1", n=64, seed=0)   # rsearch_verl/toy/demos.py: SFT demos
CLI (build or find the cached world, print its paths and a few questions; `--corpus-out` copies the corpus, e.g. for
launch/retriever.sh's CORPUS, see docs/quick_tour.md):
    .venv/bin/python -m rsearch_verl.toy.world --seed 0 --n-entities 320 [--cache-dir DIR] [--corpus-out F.jsonl]
    .venv/bin/python -m rsearch_verl.toy.world --data toy_world_hard   # the knobs of recipes/data/<name>.yaml
    python -m rsearch_verl.toy.tokenizer --protocols search_r1   # its tokenizer (toy/tokenizer.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from dataclasses import dataclass

from rsearch_verl.config import ToyWorldConfig, load_config
from rsearch_verl.publish import publish_dir
from rsearch_verl.toy.entities import Entity, fact_sentence, make_side, name_pools, question_record
from rsearch_verl.toy.world_hard import HARD_VERSION, KNOBS, generate_hard, uses_hard_generator

logger = logging.getLogger(__name__)

# Bump when the generator changes, so cached worlds built by older code are not reused.
GENERATOR_VERSION = 3
VAL_ENTITY_SHARE = 0.3  # of the entities; ~4 questions per person, so 30 % of 320 covers n_val=64 (half 2-hop)
# The share of 2-hop questions is ToyWorldConfig.two_hop_share (0.5; filled with 1-hop ones when short).


@dataclass
class World:
    root: str
    corpus_path: str
    train_path: str
    val_path: str
    cfg: ToyWorldConfig
    entities: list[Entity]

    def by_name(self) -> dict[str, Entity]:
        return {e.name: e for e in self.entities}

    def passages(self) -> dict[str, str]:
        """passage id -> contents."""
        with open(self.corpus_path) as f:
            return {r["id"]: r["contents"] for r in map(json.loads, f)}

    def questions(self, split: str) -> list[dict]:
        path = {"train": self.train_path, "val": self.val_path}[split]
        with open(path) as f:
            return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------------------------- generation


def fact_passages(e: Entity) -> dict[str, str]:
    """attribute -> passage contents, one short passage per fact, titled by the entity:
    '"Kiro Baz"\nThe birthplace of Kiro Baz is Tul Vex.' A search for the fact's key finds exactly it, and the
    passage states the fact in the words a reader restates it in."""
    return {attr: f'"{e.name}"\n{fact_sentence(attr, e.name, value)}' for attr, value in e.attrs.items()}


def corpus_rows(rng: random.Random, entities: list[Entity], prefix: str) -> list[dict]:
    """Every fact of every entity as a corpus row, in a shuffled order (ids reveal neither the side, the kind nor
    the attribute); sets each entity's `passage_ids`."""
    facts = [(e, attr, text) for e in entities for attr, text in fact_passages(e).items()]
    rng.shuffle(facts)
    rows = []
    for pid, (e, attr, text) in enumerate(facts):
        e.passage_ids[attr] = f"{prefix}-{pid:05d}"
        rows.append({"id": e.passage_ids[attr], "contents": text})
    return rows


# (template, attribute) for 1 hop; the subject is the question's entity. Every answer is a word of a closed set
# or a name: one or two tokens the policy copies out of the retrieved passage.
ONE_HOP = {
    "person": [
        ("In which city was {s} born?", "birthplace"),
        ("What is the profession of {s}?", "profession"),
        ("What is the favourite colour of {s}?", "colour"),
    ],
    "city": [("In which region is {s} located?", "region")],
    "region": [("What animal is shown on the emblem of {s}?", "emblem")],
}
# (template, relation from the subject, attribute of the related entity)
TWO_HOP = {
    "person": [("In which region is the birthplace of {s} located?", "birthplace", "region")],
    "city": [("What animal is shown on the emblem of the region where {s} lies?", "region", "emblem")],
    "region": [],
}


def question_pool(entities: list[Entity]) -> tuple[list[dict], list[dict]]:
    by_name = {e.name: e for e in entities}
    one, two = [], []
    for e in entities:
        for template, attr in ONE_HOP[e.kind]:
            if attr in e.attrs:
                chain = [e.name] + ([e.attrs[attr]] if attr in ("mentor", "birthplace", "region") else [])
                one.append(question_record(template.format(s=e.name), e.attrs[attr], 1, chain, [e.passage_ids[attr]]))
        for template, rel, attr in TWO_HOP[e.kind]:
            mid = by_name.get(e.attrs.get(rel, ""))
            if mid is not None and attr in mid.attrs:
                chain = [e.name, mid.name] + ([mid.attrs[attr]] if attr in ("mentor", "birthplace", "region") else [])
                support = [e.passage_ids[rel], mid.passage_ids[attr]]
                two.append(question_record(template.format(s=e.name), mid.attrs[attr], 2, chain, support))
    return one, two


def _pick(rng: random.Random, one: list[dict], two: list[dict], n: int, side: str, share: float) -> list[dict]:
    if n > len(one) + len(two):
        raise ValueError(
            f"toy_world: the {side} side has only {len(one) + len(two)} questions but {n} were asked for; "
            "raise toy_world.n_entities or lower n_train / n_val"
        )
    one, two = rng.sample(one, len(one)), rng.sample(two, len(two))
    n_two = min(len(two), round(n * share))
    n_one = min(len(one), n - n_two)
    n_two = n - n_one  # fill from 2-hop when 1-hop questions run short
    picked = one[:n_one] + two[:n_two]
    rng.shuffle(picked)
    return [{"id": f"tw-{side}-{i:04d}", **q} for i, q in enumerate(picked)]


def n_val_entities(cfg: ToyWorldConfig) -> int:
    """How many of the `n_entities` are validation ones (a harder world's twins come on top)."""
    return max(10, round(cfg.n_entities * VAL_ENTITY_SHARE))


def generate(cfg: ToyWorldConfig) -> tuple[list[Entity], list[dict], list[dict], list[dict]]:
    """(entities, corpus rows, train questions, val questions), a pure function of cfg (not of cache_dir)."""
    rng = random.Random(f"toy-world-{cfg.seed}")
    n_val = n_val_entities(cfg)
    pools, used = name_pools(rng, cfg.n_entities), set()
    if uses_hard_generator(cfg):
        return generate_hard(cfg, rng, pools, n_val)
    entities = make_side(rng, "train", cfg.n_entities - n_val, pools, used)
    entities += make_side(rng, "val", n_val, pools, used)
    corpus = corpus_rows(rng, entities, "tw")
    splits = {}
    for side, n in (("train", cfg.n_train), ("val", cfg.n_val)):
        one, two = question_pool([e for e in entities if e.side == side])
        splits[side] = _pick(rng, one, two, n, side, cfg.two_hop_share)
    return entities, corpus, splits["train"], splits["val"]


# ----------------------------------------------------------------------------------------------- cache


def world_fields(cfg: ToyWorldConfig) -> dict:
    """The config as cache keys see it: every field but `cache_dir` (where a cache lies is no part of what it holds, so
    a copied ~/.cache or another $HOME finds it), and the harder worlds' knobs only
    where they differ from their defaults, so the keys of worlds that never set them (the default world's hash, its
    manifest, the warm start's key) stayed what they were before the knobs existed. A harder world adds its
    generator's version: its caches, the warm start's too, move when that generator changes."""
    defaults = ToyWorldConfig()
    fields = dataclasses.asdict(cfg)
    out = {k: v for k, v in fields.items() if k != "cache_dir" and (k not in KNOBS or v != getattr(defaults, k))}
    if uses_hard_generator(cfg):
        out["hard_version"] = HARD_VERSION
    return out


def world_hash(cfg: ToyWorldConfig) -> str:
    key = world_fields(cfg)
    key["version"] = GENERATOR_VERSION
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def _write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _load(root: str, cfg: ToyWorldConfig) -> World:
    with open(os.path.join(root, "entities.json")) as f:
        entities = [Entity(**e) for e in json.load(f)]
    paths = {k: os.path.join(root, f"{k}.jsonl") for k in ("corpus", "train", "val")}
    return World(root, paths["corpus"], paths["train"], paths["val"], cfg, entities)


_ANNOUNCED: set[str] = set()  # worlds this process has logged "reusing" for


def build_toy_world(cfg: ToyWorldConfig) -> World:
    """Build the world for `cfg` or reuse the cached one (same config -> same files, byte for byte)."""
    if cfg.n_entities < 20 or cfg.n_train < 1 or cfg.n_val < 1:
        raise ValueError("toy_world: need n_entities >= 20 and n_train, n_val >= 1")
    base = os.path.abspath(os.path.expanduser(cfg.cache_dir))
    root = os.path.join(base, world_hash(cfg))
    if os.path.exists(os.path.join(root, "world.json")):
        # once per world and process at INFO: the data, the tokenizer and the warm start each load the same world
        logger.log(logging.DEBUG if root in _ANNOUNCED else logging.INFO, "toy world: reusing %s", root)
        _ANNOUNCED.add(root)
        return _load(root, cfg)
    os.makedirs(base, exist_ok=True)
    entities, corpus, train, val = generate(cfg)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=base)
    try:
        _write_jsonl(os.path.join(tmp, "corpus.jsonl"), corpus)
        _write_jsonl(os.path.join(tmp, "train.jsonl"), train)
        _write_jsonl(os.path.join(tmp, "val.jsonl"), val)
        with open(os.path.join(tmp, "entities.json"), "w") as f:
            json.dump([dataclasses.asdict(e) for e in entities], f, indent=1)
        # cache_dir stays out: the files are the same wherever they are cached
        manifest = {"config": world_fields(cfg), "hash": world_hash(cfg), "version": GENERATOR_VERSION}
        manifest.update({"n_passages": len(corpus), "n_train": len(train), "n_val": len(val)})
        with open(os.path.join(tmp, "world.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        publish_dir(tmp, root, marker="world.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("toy world: built %s (%d passages, %d train, %d val)", root, len(corpus), len(train), len(val))
    return _load(root, cfg)


def _recipe_knobs(name: str) -> dict:
    """The harder worlds' knobs `data=<name>` (recipes/data/<name>.yaml) sets, as Hydra composes them (under any
    recipe: the data group alone decides `data.toy_world`)."""

    try:
        world = load_config(["+recipe=search_r1_ppo", f"data={name}"]).data.toy_world
    except Exception as exc:  # noqa: BLE001 - Hydra's missing-config error, or our ConfigError: say which name
        raise SystemExit(f"toy_world: data={name} does not compose ({exc})") from exc
    return {k: getattr(world, k) for k in KNOBS}


def main(argv: list[str] | None = None) -> None:
    defaults = ToyWorldConfig()
    parser = argparse.ArgumentParser(description="Build (or find) the cached toy world and print where it is.")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--n-entities", type=int, default=defaults.n_entities)
    parser.add_argument("--n-train", type=int, default=defaults.n_train)
    parser.add_argument("--n-val", type=int, default=defaults.n_val)
    parser.add_argument("--cache-dir", default=defaults.cache_dir)
    parser.add_argument("--corpus-out", default=None, help="also copy the corpus JSONL here (for launch/retriever.sh)")
    parser.add_argument("--data", default=None, help="the knobs (not the sizes) of recipes/data/NAME.yaml's toy_world")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    knobs = _recipe_knobs(args.data) if args.data else {}
    cfg = ToyWorldConfig(args.seed, args.n_entities, args.n_train, args.n_val, args.cache_dir, **knobs)
    world = build_toy_world(cfg)
    if args.corpus_out:
        shutil.copyfile(world.corpus_path, args.corpus_out)
        logger.info("toy world: corpus (%s) copied to %s", world.corpus_path, args.corpus_out)
    for label, path in (("corpus", world.corpus_path), ("train", world.train_path), ("val", world.val_path)):
        print(f"{label}\t{path}")  # noqa: T201
    for q in world.questions("val")[:3]:
        print(f"example\t{q['question']} -> {q['golden_answers'][0]}")  # noqa: T201


if __name__ == "__main__":
    main()
