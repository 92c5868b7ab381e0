"""The embedded toy world: a seeded, fictional knowledge base whose questions can only be answered by searching.

People, cities and regions get made-up, syllable-generated names (never real words); people have a birthplace,
a birth year, a profession, a favourite colour and usually a mentor; cities lie in a region and have a founding
year; regions have an emblem animal. Each entity becomes one passage of the corpus
(`{"id", "contents": "\"Title\"\ntext"}`, the FlashRAG / Search-R1 format). Questions need 1 hop ("What is the
profession of Zorvan Quell?") or 2 hops ("In which city was the mentor of Zorvan Quell born?").

The entities are partitioned into two disconnected sub-worlds, train and val, and every question (its subject,
the entities on its hop chain and its answer) comes from one side only: validation answers cannot be memorised
from training questions, only found in the corpus. Attribute values (colours, professions, years) are shared.

Files, cached under `cfg.cache_dir/<hash of the ToyWorldConfig>/` (built in a temp dir and renamed, so a half
written world is never reused): `corpus.jsonl`, `train.jsonl`, `val.jsonl` (`{"id", "question",
"golden_answers", "data_source": "toy_world_1hop" | "toy_world_2hop", "hops", "entities", "support"}`;
`support` lists the passage ids of the hop chain), `entities.json`, `world.json` (written last = complete).

Usage:
    world = build_toy_world(cfg.data.toy_world)        # -> World(root, corpus_path, train_path, val_path, ...)
    tok_dir = toy_tokenizer(world, ["search_r1"])      # small BPE tokenizer dir for the tiny Qwen2 policy
    demos = demonstrations(world, "search_r1", n=64, seed=0)   # imperfect SFT trajectories
CLI (build or find the cached world, print its paths and a few questions):
    python -m rsearch_verl.data.toy_world --seed 0 --n-entities 60 [--cache-dir DIR] [--tokenizer search_r1]
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field

from rsearch_verl.config import ToyWorldConfig

logger = logging.getLogger(__name__)

# Bump when the generator changes, so cached worlds built by older code are not reused.
GENERATOR_VERSION = 1
VAL_ENTITY_SHARE = 0.3  # of the entities; questions per entity are ~12 for people, so 30 % covers n_val=64
TWO_HOP_SHARE = 0.5  # wanted share of 2-hop questions in each split (filled with 1-hop when short)
TOKENIZER_VOCAB = 3072

_ONSETS = ["b", "d", "g", "k", "l", "m", "n", "r", "s", "t", "v", "z", "th", "dr", "kr", "vr", "zh", "qu", "sk", "x"]
_NUCLEI = ["a", "e", "i", "o", "u", "ae", "ei", "ou", "y"]
_CODAS = ["", "", "", "", "n", "r", "l", "s", "x"]
# Every name carries one of these, which keeps syllable strings away from real English words.
_EXOTIC = ("z", "x", "q", "v", "th", "zh", "kr", "sk", "ae", "ei", "ou", "y")

PROFESSIONS = [
    "cartographer", "astronomer", "weaver", "glassblower", "botanist", "shipwright",
    "archivist", "clockmaker", "herbalist", "sculptor", "mapmaker", "beekeeper",
]  # fmt: skip
COLOURS = ["teal", "crimson", "amber", "violet", "ochre", "indigo", "silver", "olive", "scarlet", "ivory"]
ANIMALS = ["heron", "lynx", "stag", "otter", "falcon", "badger", "salamander", "wolf", "raven", "tortoise"]


@dataclass
class Entity:
    name: str
    kind: str  # "person" | "city" | "region"
    side: str  # "train" | "val"
    attrs: dict[str, str] = field(default_factory=dict)  # values are strings; relations hold entity names
    passage_id: str = ""


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


def _name_words(rng: random.Random, n: int, taken: set[str]) -> list[str]:
    """`n` new distinct made-up words (2 syllables); none contains another, so word-boundary checks are exact."""
    out: list[str] = []
    for _ in range(200 * n + 10_000):
        if len(out) == n:
            break
        word = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(2))
        if not 5 <= len(word) <= 8 or not any(m in word for m in _EXOTIC):
            continue
        if any(word in t or t in word for t in taken):
            continue
        taken.add(word)
        out.append(word.capitalize())
    if len(out) < n:
        raise ValueError(f"toy_world: cannot make {n} more distinct names; lower toy_world.n_entities")
    return out


def _make_side(rng: random.Random, side: str, n: int, taken: set[str]) -> list[Entity]:
    """One disconnected sub-world: relations never leave it."""
    n_regions = max(1, round(n * 0.1))
    n_cities = max(2, round(n * 0.28))
    n_people = n - n_regions - n_cities
    if n_people < 3:
        raise ValueError(f"toy_world.n_entities: too few entities for the {side} side ({n}); use >= 20 in all")
    regions = [Entity(w, "region", side, {"emblem": rng.choice(ANIMALS)}) for w in _name_words(rng, n_regions, taken)]
    cities = [
        Entity(w, "city", side, {"region": rng.choice(regions).name, "founded": str(rng.randint(900, 1600))})
        for w in _name_words(rng, n_cities, taken)
    ]
    words = _name_words(rng, 2 * n_people, taken)
    people: list[Entity] = []
    for i in range(n_people):
        attrs = {
            "birthplace": rng.choice(cities).name,
            "born": str(rng.randint(1700, 1950)),
            "profession": rng.choice(PROFESSIONS),
            "colour": rng.choice(COLOURS),
        }
        # Mentors come from earlier people, so the mentor graph is a forest (no cycles); most people have one.
        if people and rng.random() < 0.85:
            attrs["mentor"] = rng.choice(people).name
        people.append(Entity(f"{words[2 * i]} {words[2 * i + 1]}", "person", side, attrs))
    return regions + cities + people


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _passage_text(e: Entity, students: list[str], born_here: list[str], cities_in: list[str]) -> str:
    a = e.attrs
    if e.kind == "person":
        text = (
            f"{e.name} is {_article(a['profession'])} {a['profession']} "
            f"who was born in {a['birthplace']} in {a['born']}. "
            f"The favourite colour of {e.name} is {a['colour']}."
        )
        if "mentor" in a:
            text += f" {e.name} was trained by the mentor {a['mentor']}."
        if students:
            text += f" {e.name} was the mentor of {', '.join(students)}."
    elif e.kind == "city":
        text = f"{e.name} is a city in the region of {a['region']}. It was founded in {a['founded']}."
        if born_here:
            text += f" People born in {e.name} include {', '.join(born_here)}."
    else:
        text = f"{e.name} is a region whose emblem shows a {a['emblem']}."
        if cities_in:
            text += f" Its cities include {', '.join(cities_in)}."
    return f'"{e.name}"\n{text}'


def _corpus(rng: random.Random, entities: list[Entity]) -> list[dict]:
    order = list(range(len(entities)))
    rng.shuffle(order)  # passage ids must not reveal the side or the kind
    for pid, i in enumerate(order):
        entities[i].passage_id = f"tw-{pid:04d}"
    rows = []
    for i in order:
        e = entities[i]
        students = [p.name for p in entities if p.attrs.get("mentor") == e.name]
        born_here = [p.name for p in entities if p.attrs.get("birthplace") == e.name]
        cities_in = [c.name for c in entities if c.kind == "city" and c.attrs.get("region") == e.name]
        rows.append({"id": e.passage_id, "contents": _passage_text(e, students, born_here, cities_in)})
    return rows


# (template, attribute) for 1 hop; the subject is the question's entity
_ONE_HOP = {
    "person": [
        ("In which city was {s} born?", "birthplace"),
        ("In what year was {s} born?", "born"),
        ("What is the profession of {s}?", "profession"),
        ("What is the favourite colour of {s}?", "colour"),
        ("Who was the mentor of {s}?", "mentor"),
    ],
    "city": [("In which region is {s} located?", "region"), ("In what year was {s} founded?", "founded")],
    "region": [("What animal is shown on the emblem of {s}?", "emblem")],
}
# (template, relation from the subject, attribute of the related entity)
_TWO_HOP = {
    "person": [
        ("In which city was the mentor of {s} born?", "mentor", "birthplace"),
        ("In what year was the mentor of {s} born?", "mentor", "born"),
        ("What is the profession of the mentor of {s}?", "mentor", "profession"),
        ("What is the favourite colour of the mentor of {s}?", "mentor", "colour"),
        ("Who was the mentor of the mentor of {s}?", "mentor", "mentor"),
        ("In which region is the birthplace of {s} located?", "birthplace", "region"),
        ("In what year was the birthplace of {s} founded?", "birthplace", "founded"),
    ],
    "city": [("What animal is shown on the emblem of the region where {s} lies?", "region", "emblem")],
    "region": [],
}


def _question_pool(entities: list[Entity]) -> tuple[list[dict], list[dict]]:
    by_name = {e.name: e for e in entities}
    one, two = [], []
    for e in entities:
        for template, attr in _ONE_HOP[e.kind]:
            if attr in e.attrs:
                chain = [e.name] + ([e.attrs[attr]] if attr in ("mentor", "birthplace", "region") else [])
                one.append(_question(template.format(s=e.name), e.attrs[attr], 1, chain, [e.passage_id]))
        for template, rel, attr in _TWO_HOP[e.kind]:
            mid = by_name.get(e.attrs.get(rel, ""))
            if mid is not None and attr in mid.attrs:
                chain = [e.name, mid.name] + ([mid.attrs[attr]] if attr in ("mentor", "birthplace", "region") else [])
                two.append(
                    _question(template.format(s=e.name), mid.attrs[attr], 2, chain, [e.passage_id, mid.passage_id])
                )
    return one, two


def _question(text: str, answer: str, hops: int, chain: list[str], support: list[str]) -> dict:
    return {
        "question": text,
        "golden_answers": [answer],
        "data_source": f"toy_world_{hops}hop",
        "hops": hops,
        "entities": chain,
        "support": support,
    }


def _pick(rng: random.Random, one: list[dict], two: list[dict], n: int, side: str) -> list[dict]:
    if n > len(one) + len(two):
        raise ValueError(
            f"toy_world: the {side} side has only {len(one) + len(two)} questions but {n} were asked for; "
            "raise toy_world.n_entities or lower n_train / n_val"
        )
    one, two = rng.sample(one, len(one)), rng.sample(two, len(two))
    n_two = min(len(two), round(n * TWO_HOP_SHARE))
    n_one = min(len(one), n - n_two)
    n_two = n - n_one  # fill from 2-hop when 1-hop questions run short
    picked = one[:n_one] + two[:n_two]
    rng.shuffle(picked)
    return [{"id": f"tw-{side}-{i:04d}", **q} for i, q in enumerate(picked)]


def generate(cfg: ToyWorldConfig) -> tuple[list[Entity], list[dict], list[dict], list[dict]]:
    """(entities, corpus rows, train questions, val questions), a pure function of cfg (not of cache_dir)."""
    rng = random.Random(f"toy-world-{cfg.seed}")
    n_val = max(10, round(cfg.n_entities * VAL_ENTITY_SHARE))
    taken: set[str] = set()
    entities = _make_side(rng, "train", cfg.n_entities - n_val, taken) + _make_side(rng, "val", n_val, taken)
    corpus = _corpus(rng, entities)
    splits = {}
    for side, n in (("train", cfg.n_train), ("val", cfg.n_val)):
        one, two = _question_pool([e for e in entities if e.side == side])
        splits[side] = _pick(rng, one, two, n, side)
    return entities, corpus, splits["train"], splits["val"]


# ----------------------------------------------------------------------------------------------- cache


def world_hash(cfg: ToyWorldConfig) -> str:
    key = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "cache_dir"}
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


def build_toy_world(cfg: ToyWorldConfig) -> World:
    """Build the world for `cfg` or reuse the cached one (same config -> same files, byte for byte)."""
    if cfg.n_entities < 20 or cfg.n_train < 1 or cfg.n_val < 1:
        raise ValueError("toy_world: need n_entities >= 20 and n_train, n_val >= 1")
    base = os.path.abspath(os.path.expanduser(cfg.cache_dir))
    root = os.path.join(base, world_hash(cfg))
    if os.path.exists(os.path.join(root, "world.json")):
        logger.info("toy world: reusing %s", root)
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
        config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "cache_dir"}
        manifest = {"config": config, "hash": world_hash(cfg), "version": GENERATOR_VERSION}
        manifest.update({"n_passages": len(corpus), "n_train": len(train), "n_val": len(val)})
        with open(os.path.join(tmp, "world.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        _publish(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("toy world: built %s (%d passages, %d train, %d val)", root, len(corpus), len(train), len(val))
    return _load(root, cfg)


def _publish(tmp: str, root: str, marker: str = "world.json") -> None:
    """Atomic rename into place; `marker` is the file whose presence means complete. A concurrent builder that
    won the race leaves an identical directory there, which is kept."""
    if os.path.exists(root) and not os.path.exists(os.path.join(root, marker)):
        shutil.rmtree(root, ignore_errors=True)  # a leftover from a build killed mid-rename
    try:
        os.rename(tmp, root)
    except OSError:
        if not os.path.exists(os.path.join(root, marker)):
            raise


# ----------------------------------------------------------------------------------------------- tokenizer


def toy_tokenizer(world: World, protocols: list[str], vocab_size: int = TOKENIZER_VOCAB) -> str:
    """A small byte-level BPE tokenizer for the tiny policy, trained on the corpus, the questions and each
    protocol's prompt / tag / observation text, with the protocols' special tokens; cached; returns its dir.

    The world's own names are swapped for other random names of the same syllable generator before training,
    so no entity gets a token of its own: every name, train or val, is spelt with the same syllable pieces,
    and a policy that learned to copy training names into queries can copy unseen validation names too.
    """
    from rsearch_verl.models import train_bpe_tokenizer
    from rsearch_verl.rollout.protocols import get_protocol

    names = sorted(set(protocols))
    # the protocols' templates and special tokens are part of the key: editing a protocol retrains the tokenizer
    fingerprint = [(n, get_protocol(n).special_tokens, get_protocol(n).build_prompt("Q?", "base")) for n in names]
    key = hashlib.sha1(json.dumps([fingerprint, vocab_size, GENERATOR_VERSION]).encode()).hexdigest()[:10]
    out = os.path.join(world.root, f"tokenizer_{key}")
    if os.path.exists(os.path.join(out, "tokenizer_config.json")):
        return out
    questions = world.questions("train") + world.questions("val")
    texts = list(world.passages().values()) + [q["question"] for q in questions]
    specials: list[str] = []
    for name in names:
        proto = get_protocol(name)
        specials += [t for t in proto.special_tokens if t not in specials]
        for q in questions[:16]:
            for variant in ("base", "instruct"):
                prompt = proto.build_prompt(q["question"], variant)
                texts.append(prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt))
        try:
            texts += ["".join(t for _, t in d["segments"]) for d in demonstrations(world, name, n=32, seed=0)]
        except ValueError as exc:  # demos only sharpen merges; the byte-level tokenizer still covers everything
            logger.warning("toy tokenizer: no demonstrations for %s (%s)", name, exc)
    tok = train_bpe_tokenizer(_rename_entities(world, texts), vocab_size=vocab_size, extra_special=specials)
    tmp = tempfile.mkdtemp(prefix=".tok-", dir=world.root)
    try:
        tok.save_pretrained(tmp)
        _publish(tmp, out, marker="tokenizer_config.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("toy world: tokenizer with %d tokens for %s at %s", len(tok), names, out)
    return out


def _rename_entities(world: World, texts: list[str]) -> list[str]:
    import re

    words = sorted({w for e in world.entities for w in e.name.split()}, key=len, reverse=True)
    rng = random.Random("toy-tokenizer")
    pool = _name_words(rng, 4 * len(words), {w.lower() for w in words})
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, words)) + r")\b")
    return [pattern.sub(lambda _: rng.choice(pool), text) for text in texts]


# ----------------------------------------------------------------------------------------------- demonstrations

# How the policy writes a thought, a search call and the final answer in each protocol (the papers' formats).
# Every rendered demonstration is checked against the protocol's own parser, so a mismatch fails loudly.
DEMO_FORMATS = {
    "search_r1": ("<think> {t} </think>\n", "<search> {q} </search>", "<answer> {a} </answer>"),
    "research": (
        "<think> {t} </think>\n",
        "<search> {q} </search>",
        "<answer> The final answer is \\boxed{{{a}}} </answer>",
    ),
    "r1_searcher": ("<think> {t} </think>\n", "<|begin_of_query|> {q} <|end_of_query|>", "<answer> {a} </answer>"),
    "r_search": ("{t}\n", "<search> {q} </search>", "<answer> {a} </answer>"),
    "nl_dag": ("<think> {t} </think>\n", "<search>\nA: {q} (Wiki)\n</search>", "<answer> {a} </answer>"),
}
_PHRASE = {
    "birthplace": "the birthplace", "born": "the birth year", "profession": "the profession",
    "colour": "the favourite colour", "mentor": "the mentor", "region": "the region",
    "founded": "the founding year", "emblem": "the emblem animal",
}  # fmt: skip


def _run_sync(make_coro):
    """Run a coroutine from sync code, also when the caller already runs an event loop (then in a thread)."""
    import asyncio
    import concurrent.futures

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make_coro())).result()


def _fake_search(world: World, rng: random.Random):
    """A SearchFn over the world's corpus that looks like the retriever: the passage of the entity named in the
    query first, then random other passages."""
    from rsearch_verl.rollout.protocols.base import Doc

    passages = world.passages()
    ids = sorted(passages)
    by_name = {e.name.lower(): e.passage_id for e in world.entities}

    async def search(queries: list[str], topk: int, source: str = "local") -> list[list[Doc]]:
        out = []
        for query in queries:
            hits = [pid for name, pid in by_name.items() if name in query.lower()][:1]
            hits += [pid for pid in rng.sample(ids, min(len(ids), topk + 1)) if pid not in hits]
            out.append([Doc(pid, passages[pid], score=1.0 - 0.1 * i) for i, pid in enumerate(hits[:topk])])
        return out

    return search


def _guess(world: World, rng: random.Random, q: dict) -> str:
    """A plausible but usually wrong answer of the right type (what a model answering from memory says)."""
    answer = q["golden_answers"][0]
    if answer.isdigit():
        return str(int(answer) + rng.choice([-30, -7, -1, 1, 12, 45]))
    for pool in (PROFESSIONS, COLOURS, ANIMALS):
        if answer in pool:
            return rng.choice(pool)
    kind = world.by_name()[answer].kind
    return rng.choice([e.name for e in world.entities if e.kind == kind and e.side == "train"])


def _search_segments(proto, fmt, q: dict, search, topk: int) -> list[tuple[str, str]]:
    """One (search turn, observation) pair per hop, each searching the hop's entity by name."""
    think, call, _ = fmt
    attrs = _question_attrs(q)
    segments: list[tuple[str, str]] = []
    for hop in range(q["hops"]):
        subject = q["entities"][hop]
        if hop == 0:
            thought = f"I need to find {_PHRASE[attrs[0]]} of {subject}."
        else:
            prev = q["entities"][hop - 1]
            thought = (
                f"{_PHRASE[attrs[0]].capitalize()} of {prev} is {subject}. Now I need {_PHRASE[attrs[1]]} of {subject}."
            )
        turn = think.format(t=thought) + call.format(q=subject)
        action = proto.parse_turn(turn)
        if action.kind != "search" or not action.queries:
            raise ValueError(f"demonstrations: protocol {proto.name!r} does not parse the search turn {turn!r}")
        obs = _run_sync(lambda a=action: proto.observe(a, search, topk))
        segments += [("policy", turn), ("observation", obs)]
    return segments


def _question_attrs(q: dict) -> list[str]:
    """The attribute asked at each hop, recovered from the world's templates."""
    for kind in _ONE_HOP:
        for template, attr in _ONE_HOP[kind]:
            if q["hops"] == 1 and template.format(s=q["entities"][0]) == q["question"]:
                return [attr]
        for template, rel, attr in _TWO_HOP[kind]:
            if q["hops"] == 2 and template.format(s=q["entities"][0]) == q["question"]:
                return [rel, attr]
    raise ValueError(f"demonstrations: {q['question']!r} matches no toy-world template")


def _evidence(world: World, protocol_name: str, q: dict) -> str:
    """R-Search writes the supporting passages' text, unmodified, as evidence before its answer (not masked)."""
    if protocol_name != "r_search":
        return ""
    passages = world.passages()
    text = " ".join(passages[pid].split("\n", 1)[1] for pid in q["support"])
    return f"<original_evidence> {text} </original_evidence>\n"


def demonstrations(
    world: World, protocol_name: str, n: int, seed: int, p_no_search: float = 0.5, variant: str = "base", topk: int = 3
) -> list[dict]:
    """Synthetic, deliberately imperfect demonstrations on TRAIN questions for a warm-start SFT stage.

    With probability `p_no_search` the demonstration answers at once from "memory" (a guess of the right type,
    usually wrong); otherwise it searches each hop's entity, sees the protocol's real observation of
    retrieved-looking passages and answers correctly. Returns dicts {"prompt", "segments": [(role, text)],
    "answer", "question", "searched"}; role is "policy" or "observation" (the latter is masked in SFT).
    """
    from rsearch_verl.rollout.protocols import get_protocol

    if protocol_name not in DEMO_FORMATS:
        raise ValueError(f"demonstrations: no demo format for {protocol_name!r} (known: {sorted(DEMO_FORMATS)})")
    proto, fmt = get_protocol(protocol_name), DEMO_FORMATS[protocol_name]
    rng = random.Random(f"demos-{seed}-{protocol_name}")
    search = _fake_search(world, rng)
    questions = world.questions("train")
    out = []
    for _ in range(n):
        q = rng.choice(questions)
        searched = rng.random() >= p_no_search
        if searched:
            segments = _search_segments(proto, fmt, q, search, topk)
            answer = q["golden_answers"][0]
            final = (
                fmt[0].format(t=f"The answer is {answer}.")
                + _evidence(world, protocol_name, q)
                + fmt[2].format(a=answer)
            )
        else:
            segments, answer = [], _guess(world, rng, q)
            final = fmt[0].format(t="I think I know this without searching.") + fmt[2].format(a=answer)
        segments.append(("policy", final))
        got = proto.extract_answer("".join(t for role, t in segments if role == "policy"))
        if got is None or got.strip() != answer:
            raise ValueError(f"demonstrations: protocol {protocol_name!r} extracts {got!r}, wanted {answer!r}")
        prompt = proto.build_prompt(q["question"], variant)
        out.append(
            {"prompt": prompt, "segments": segments, "answer": answer, "question": q["question"], "searched": searched}
        )
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    defaults = ToyWorldConfig()
    parser = argparse.ArgumentParser(description="Build (or find) the cached toy world and print where it is.")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--n-entities", type=int, default=defaults.n_entities)
    parser.add_argument("--n-train", type=int, default=defaults.n_train)
    parser.add_argument("--n-val", type=int, default=defaults.n_val)
    parser.add_argument("--cache-dir", default=defaults.cache_dir)
    parser.add_argument("--tokenizer", default="", help="comma-separated protocols: also build the toy tokenizer")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = ToyWorldConfig(args.seed, args.n_entities, args.n_train, args.n_val, args.cache_dir)
    world = build_toy_world(cfg)
    for label, path in (("corpus", world.corpus_path), ("train", world.train_path), ("val", world.val_path)):
        print(f"{label}\t{path}")  # noqa: T201
    if args.tokenizer:
        print(f"tokenizer\t{toy_tokenizer(world, args.tokenizer.split(','))}")  # noqa: T201
    for q in world.questions("val")[:3]:
        print(f"example\t{q['question']} -> {q['golden_answers'][0]}")  # noqa: T201


if __name__ == "__main__":
    main()
