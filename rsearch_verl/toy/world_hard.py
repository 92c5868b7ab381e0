"""The harder toy world (`data=toy_world_hard`): the default world's generator with the ways real search is hard.

Turned on by the `ToyWorldConfig` knobs beyond the sizes (rsearch_verl/config/schema.py; at their defaults the world is
the default one, built by rsearch_verl/toy/world.py alone, byte for byte):
  - `three_hop_share` (and `two_hop_share`): 3-hop questions ("In which region is the birthplace of the mentor of X
    located?") beside 1- and 2-hop ones, and more question types (a person's mentor and birth year, a city's founding).
  - `distractors`: near-twin entities, their name one syllable off a real one's ("Kiro Baz" / "Kiro Bax": one word
    shared, the other a variant), on both sides; a third of a side's twins copy a name of the other side. Every
    fact a twin shares with its original is redrawn, so a sloppy query or a sloppy read gets a wrong answer.
  - `facts_per_passage` / `context_sentences`: each passage states its entity's asked facts ("The birthplace of Kiro
    Baz is Tul Vex.") among sentences never asked about (CONTEXT: most name another entity or a value of an
    answer's type, "Kiro Baz later found work far from the hometown, in the town of Tul Vem."; twins' notes) and
    fillers, so every passage of an entity names it as often and has as many sentences.
  - `paraphrase`: questions worded unlike the passages ("Who taught Kiro Baz?" for "the mentor of Kiro Baz"). Their
    cue words ("town", "born", "student", "shade", "province") are the context sentences' words, never those of the
    passage holding the asked fact (`AVOID`), so BM25 on the question text ranks the entity's other passages (or
    its namesakes') first, while the fact's key finds its passage: a search has to be reformulated.

Each question record adds `path` (the attribute asked at each hop) to the default world's fields. Measured (BM25 over
the corpus, top 3, tests/toy/test_toy_world_hard.py): the question text finds its first hop's passage for about a
third of the questions, the fact's key for all of them.

Usage (through the world):
    world = build_toy_world(ToyWorldConfig(three_hop_share=0.3, distractors=0.5, context_sentences=2,
                                           paraphrase=True))   # the knobs of recipes/data/toy_world_hard.yaml
    .venv/bin/python -m rsearch_verl.toy.world --data toy_world_hard   # build it, print its paths and questions
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from rsearch_verl.toy.entities import (
    ANIMALS,
    COLOURS,
    PHRASE,
    PROFESSIONS,
    Entity,
    draw_names,
    fact_sentence,
    populate,
    question_record,
    side_counts,
    variant_word,
)

# Bump when this generator changes (part of a hard world's cache key; the default world's stays GENERATOR_VERSION's).
HARD_VERSION = 1
KNOBS = (
    "two_hop_share", "three_hop_share", "distractors", "facts_per_passage", "context_sentences", "paraphrase",
    "deep_share",
)  # fmt: skip
DEEP_HOPS = (4, 5, 6)  # the deep world's chains (data=toy_world_deep, toy_world.deep_share)
OTHER_SIDE_TWINS = 1 / 3  # of a side's twins: near-copies of a name on the other side
RELATIONS = ("birthplace", "mentor", "region")  # attributes whose value is an entity


@dataclass(frozen=True)
class Context:
    """A kind of sentence never asked about. It names a value of some question's answer type (a trap for a sloppy
    read) and carries cue words of some questions' paraphrases, so it draws a search that copies the question; it
    never shares a passage with the first fact those questions ask (`AVOID`, below the questions)."""

    kind: str
    template: str  # {s}: the entity, {v}: the value
    values: str  # what the value is drawn from: an entity kind, a closed set, or "year" (years after `unlike`)
    unlike: str | None  # the entity's fact whose value it never repeats


CONTEXT = {
    "workplace": Context("person", "{s} later found work far from the hometown, in the town of {v}.", "city",
                         "birthplace"),
    "teaching": Context("person", "{s} was a teacher who taught the trade in the town of {v}.", "city", "birthplace"),
    "family_trade": Context("person", "{s} was born into a family that made a living as {v}s.", "profession",
                            "profession"),
    "school": Context("person", "{s} founded a small school in the town of {v}.", "city", "birthplace"),
    "peer": Context("person", "As a student, {s} shared a study with {v}.", "person", "mentor"),
    "travel": Context("person", "As a young student, {s} travelled across the province of {v}.", "region", None),
    "cloak": Context("person", "{s} mostly wore a cloak in a {v} shade.", "colour", "colour"),
    "moved": Context("person", "In the year {v}, {s} moved to a new workshop.", "year", "born"),
    "partner": Context("city", "{s} trades with the city of {v}.", "city", None),
    "visitors": Context("city", "Many traders from the province of {v} come to {s}.", "region", "region"),
    "road": Context("city", "{s} lies on the old road to the province of {v}.", "region", "region"),
    "former": Context("city", "{s} was once part of the province of {v}.", "region", "region"),
    "mascot": Context("city", "The people of {s} keep the {v} as a lucky creature.", "emblem", None),
    "market": Context("city", "A great market was founded in {s} in the year {v}.", "year", "founded"),
    "wildlife": Context("region", "The {v} is the most common creature in {s}.", "emblem", "emblem"),
    "neighbour": Context("region", "{s} borders the province of {v}.", "region", None),
}  # fmt: skip
YEARS_AFTER = {"moved": (18, 60), "market": (20, 300)}  # a "year" value: this many years after `unlike`
# Sentences with neither a value nor a cue word, which fill a passage up to its `context_sentences`: every passage of
# an entity then names it as often, so BM25 on the name alone cannot tell the one holding the asked fact apart.
FILLERS = {
    "person": ["{s} kept a diary for many years.", "{s} was fond of long walks.", "{s} rarely spoke of the past.",
               "{s} owned a small collection of old maps.", "{s} enjoyed quiet evenings by the fire."],
    "city": ["{s} is known for its narrow streets.", "The streets of {s} are quiet at night.",
             "Most houses in {s} have red roofs.", "{s} holds a fair every spring."],
    "region": ["{s} has long, cold winters.", "Much of {s} is covered by forest.", "Few roads cross {s}.",
               "Rivers run through most of {s}."],
}  # fmt: skip
TWIN_NOTE = "{s} is not to be confused with {v}."  # in a passage of each twin and of its original

# (kind, path, plain wording, paraphrases): the plain wording names the facts as the passages do (the default world's
# style); paraphrases avoid the facts' words. Answers stay names or words of closed sets, copied from a passage.
QUESTIONS = [
    ("person", ("birthplace",), "In which city was {s} born?",
     ["In which town was {s} born?", "Which town is the hometown of {s}?", "{s} was born in which town?"]),
    ("person", ("profession",), "What is the profession of {s}?",
     ["What work does {s} do for a living?", "What trade does {s} practise?", "What work does {s} do?"]),
    ("person", ("colour",), "What is the favourite colour of {s}?",
     ["Which shade does {s} like best?", "What shade does {s} prefer?"]),
    ("person", ("born",), "What is the birth year of {s}?", ["When was {s} born?", "{s} was born when?"]),
    ("person", ("mentor",), "Who is the mentor of {s}?",
     ["Who taught {s}?", "Under whom did {s} study as a student?", "Who was the teacher of {s}?"]),
    ("city", ("region",), "In which region is {s} located?",
     ["{s} lies in which province?", "Which province is the city {s} part of?"]),
    ("city", ("founded",), "What is the founding year of {s}?",
     ["When was {s} founded?", "In what year was the city {s} founded?"]),
    ("region", ("emblem",), "What animal is shown on the emblem of {s}?",
     ["Which creature appears on the crest of {s}?", "What creature is pictured on the banner of {s}?"]),
    ("person", ("birthplace", "region"), "In which region is the birthplace of {s} located?",
     ["In what province was {s} born?", "Which province is the hometown of {s} part of?"]),
    ("city", ("region", "emblem"), "What animal is shown on the emblem of the region where {s} lies?",
     ["Which creature appears on the crest of the province that {s} belongs to?"]),
    ("person", ("mentor", "profession"), "What is the profession of the mentor of {s}?",
     ["What trade did the teacher of {s} practise?", "What work does the person who taught {s} do?"]),
    ("person", ("mentor", "birthplace"), "In which city was the mentor of {s} born?",
     ["Where was the teacher of {s} born?", "Which town is the hometown of the one who trained {s}?"]),
    ("person", ("birthplace", "founded"), "What is the founding year of the birthplace of {s}?",
     ["When was the hometown of {s} founded?", "In what year was the town where {s} was born founded?"]),
    ("person", ("mentor", "birthplace", "region"), "In which region is the birthplace of the mentor of {s} located?",
     ["In what province was the teacher of {s} born?",
      "The one who taught {s} was born in a town; which province is that town part of?"]),
    ("person", ("birthplace", "region", "emblem"),
     "What animal is shown on the emblem of the region where {s} was born?",
     ["Which creature appears on the crest of the province where {s} was born?"]),
    ("person", ("mentor", "mentor", "profession"), "What is the profession of the mentor of the mentor of {s}?",
     ["What trade did the teacher of the teacher of {s} practise?",
      "What work does the person who taught the teacher of {s} do?"]),
]  # fmt: skip


# Words a search engine ignores (a subset of BM25's English stop words: enough for the templates here).
_STOP = {"a", "an", "and", "as", "at", "did", "do", "does", "for", "from", "in", "is", "it", "of", "on", "that", "the",
         "to", "under", "was", "what", "when", "where", "which", "who", "whom"}  # fmt: skip


def cue_words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower())) - _STOP - {"s", "v"}


# context kind -> the first facts of the questions whose paraphrases share a cue word with it
AVOID = {
    attr: {
        path[0]
        for kind, path, _, paras in QUESTIONS
        if kind == c.kind and cue_words(c.template) & cue_words(" ".join(paras))
    }
    for attr, c in CONTEXT.items()
}


# Chains of 4-6 hops through the mentor graph (a forest: mentors come from earlier people), for the long-horizon agents
# of data=toy_world_deep: a searching policy needs one search per hop. Drawn in a pass of their own after QUESTIONS, so
# the harder world's questions (deep_share 0) are what they were.
DEEP_QUESTIONS = [
    ("person", ("mentor", "birthplace", "region", "emblem"),
     "What animal is shown on the emblem of the region where the mentor of {s} was born?",
     ["Which creature appears on the crest of the province where the teacher of {s} was born?"]),
    ("person", ("mentor", "mentor", "birthplace", "region"),
     "In which region is the birthplace of the mentor of the mentor of {s} located?",
     ["In what province was the teacher of the teacher of {s} born?"]),
    ("person", ("mentor", "mentor", "mentor", "profession"),
     "What is the profession of the mentor of the mentor of the mentor of {s}?",
     ["What trade did the teacher of the teacher of the teacher of {s} practise?"]),
    ("person", ("mentor", "mentor", "birthplace", "region", "emblem"),
     "What animal is shown on the emblem of the region where the mentor of the mentor of {s} was born?",
     ["Which creature appears on the crest of the province where the teacher of the teacher of {s} was born?"]),
    ("person", ("mentor", "mentor", "mentor", "birthplace", "region"),
     "In which region is the birthplace of the mentor of the mentor of the mentor of {s} located?",
     ["In what province was the teacher of the teacher of the teacher of {s} born?"]),
    ("person", ("mentor", "mentor", "mentor", "birthplace", "region", "emblem"),
     "What animal is shown on the emblem of the region where the mentor of the mentor of the mentor of {s} was born?",
     ["Which creature appears on the crest of the province where the teacher of the teacher of the teacher of {s} "
      "was born?"]),
    ("person", ("mentor", "mentor", "mentor", "mentor", "birthplace", "region"),
     "In which region is the birthplace of the mentor of the mentor of the mentor of the mentor of {s} located?",
     ["In what province was the teacher of the teacher of the teacher of the teacher of {s} born?"]),
]  # fmt: skip


def uses_hard_generator(cfg) -> bool:
    """Whether `cfg` (a ToyWorldConfig) asks for more than the default generator does (which also honours the share
    of 2-hop questions)."""
    return bool(
        cfg.three_hop_share > 0
        or cfg.distractors > 0
        or cfg.facts_per_passage > 1
        or cfg.context_sentences > 0
        or cfg.paraphrase
        or cfg.deep_share > 0
    )


# ----------------------------------------------------------------------------------------------- entities


def name_variants(pools: dict, seed: int) -> dict[str, str]:
    """Every pool word -> its one-syllable variant (new words, none a part of another word), fixed by the world's seed:
    the world and its practice sides (rsearch_verl/toy/demos.py) spell twins with the same words."""
    rng = random.Random(f"toy-world-variants-{seed}")
    words = [w for kind in sorted(pools) for pool in pools[kind] for w in pool]
    taken = {w.lower() for w in words}
    return {w: variant_word(rng, w, taken) for w in words}


def twin_names(rng: random.Random, originals: list[str], n: int, variants: dict, used: set[str], known: set | None):
    """Up to `n` (twin, original) pairs: a twin keeps one word of its original and takes the other's variant (one
    of the `known` words, when given)."""
    out = []
    for original in rng.sample(originals, len(originals)):
        if len(out) == n:
            break
        first, second = original.split()
        options = [f"{variants[first]} {second}", f"{first} {variants[second]}"]
        options = [name for name in options if known is None or set(name.split()) <= known]
        twin = next((name for name in rng.sample(options, len(options)) if name not in used), None)
        if twin is not None:
            used.add(twin)
            out.append((twin, original))
    return out


@dataclass
class SideNames:
    """One side's names per kind: its own (drawn like the default world's) and its twins with their originals."""

    side: str
    own: dict[str, list[str]]
    twins: dict[str, list[tuple[str, str]]]

    def words(self) -> set[str]:
        return {w for kind in self.own for name in self.shuffled(None, kind) for w in name.split()}

    def shuffled(self, rng: random.Random | None, kind: str) -> list[str]:
        """Own names and twins, shuffled together (by `rng`, if any): twins take part in relations like any entity."""
        names = self.own[kind] + [twin for twin, _ in self.twins[kind]]
        return rng.sample(names, len(names)) if rng else names


def side_names(rng: random.Random, side: str, n: int, pools: dict, used: set[str]) -> SideNames:
    counts = side_counts(n, side)
    own = {kind: draw_names(rng, kind, counts[kind], pools, used) for kind in ("region", "city", "person")}
    return SideNames(side, own, {kind: [] for kind in own})


def add_twins(rng: random.Random, sides: list[SideNames], share: float, variants: dict, used: set[str]) -> None:
    """`share` twins per own name on each side; with two sides a third of them copy the other side's names. The
    second side's twins only use words the first side's names use (fewer twins when short): as in the default world,
    every word of a held-out name also names training entities, so writing it is copying tokens seen in training."""
    for k, names in enumerate(sides):
        others = [s for s in sides if s is not names]
        known = sides[0].words() if k else None
        for kind, own in names.own.items():
            n = round(share * len(own))
            n_other = round(n * OTHER_SIDE_TWINS) if others else 0
            pairs = twin_names(rng, own, n - n_other, variants, used, known)
            if n_other:
                pairs += twin_names(rng, others[0].own[kind], n_other, variants, used, known)
            names.twins[kind] = pairs


def make_hard_sides(rng: random.Random, sides: list[SideNames], context: bool) -> list[Entity]:
    """The sides' entities with their facts (relations stay within a side); each twin's facts differ from its
    original's (on either side); with `context`, the facts never asked about too."""
    entities: list[Entity] = []
    for names in sides:
        entities += populate(rng, names.side, lambda kind, names=names: names.shuffled(rng, kind))
    by_name = {e.name: e for e in entities}
    for names in sides:
        mine = [e for e in entities if e.side == names.side]
        people = [e.name for e in mine if e.kind == "person"]
        for twin, original in (pair for pairs in names.twins.values() for pair in pairs):
            _differ(rng, by_name[twin], by_name[original], mine, people)
            by_name[twin].attrs["twin_of"] = original
            by_name[original].attrs.setdefault("twin_of", twin)
        if context:
            add_context(rng, mine)
    return entities


def _differ(rng: random.Random, twin: Entity, original: Entity, entities: list[Entity], people: list[str]) -> None:
    """Redraw every fact `twin` shares with `original` (a mentor among the people before the twin, or none)."""
    for attr, value in list(twin.attrs.items()):
        if original.attrs.get(attr) != value:
            continue
        if attr == "mentor":
            earlier = [p for p in people[: people.index(twin.name)] if p != value]
            if earlier:
                twin.attrs[attr] = rng.choice(earlier)
            else:
                del twin.attrs[attr]
        else:
            others = [v for v in _choices(attr, twin, entities) if v != value]
            if not others:  # e.g. a side with one region: the twin's city cannot lie elsewhere
                raise ValueError(
                    f"toy_world: too few entities for near-twin distractors (no other {attr} for {twin.name}); "
                    "raise toy_world.n_entities or lower toy_world.distractors"
                )
            twin.attrs[attr] = rng.choice(others)


def _choices(attr: str, e: Entity, entities: list[Entity]) -> list[str]:
    """The values the fact `attr` can take on `e`'s side (a year: within 40 of the entity's own)."""
    kind = {"birthplace": "city", "region": "region"}.get(attr)
    if kind is not None:
        return [x.name for x in entities if x.kind == kind]
    if attr in ("born", "founded"):
        year = int(e.attrs[attr])
        return [str(y) for y in range(year - 40, year + 41)]
    return {"profession": PROFESSIONS, "colour": COLOURS, "emblem": ANIMALS}[attr]


def add_context(rng: random.Random, entities: list[Entity]) -> None:
    """Each entity's facts never asked about (CONTEXT), each unlike the entity's own fact of its type."""
    closed = {"profession": PROFESSIONS, "colour": COLOURS, "emblem": ANIMALS}
    for e in entities:
        for attr, c in CONTEXT.items():
            if c.kind != e.kind:
                continue
            if c.values == "year":
                e.attrs[attr] = str(int(e.attrs[c.unlike]) + rng.randint(*YEARS_AFTER[attr]))
                continue
            pool = closed.get(c.values) or [x.name for x in entities if x.kind == c.values and x.name != e.name]
            options = [v for v in pool if v != e.attrs.get(c.unlike)]
            if options:
                e.attrs[attr] = rng.choice(options)


# ----------------------------------------------------------------------------------------------- passages


def entity_passages(rng: random.Random, e: Entity, facts_per_passage: int, context: int) -> list[tuple[list, str]]:
    """[(attributes stated, contents)]: the asked facts in groups of `facts_per_passage`, each with up to `context`
    other sentences (never one whose cue words ask for a fact of its group: `AVOID`); the other sentences that fit
    nowhere make passages of their own. FILLERS bring each passage to `facts_per_passage + context` sentences (as far
    as they go), shuffled. Without `context` the other sentences are dropped (and removed from the entity)."""
    facts = [a for a in e.attrs if a in PHRASE]
    facts = rng.sample(facts, len(facts))
    groups = [facts[i : i + facts_per_passage] for i in range(0, len(facts), facts_per_passage)]
    placed, extra = [0] * len(groups), []
    others = [a for a in e.attrs if a in CONTEXT or a == "twin_of"]
    for attr in rng.sample(others, len(others)):
        fits = [i for i, group in enumerate(groups) if placed[i] < context and not AVOID.get(attr, set()) & set(group)]
        if fits:
            least = min(placed[i] for i in fits)
            i = rng.choice([i for i in fits if placed[i] == least])
            groups[i].append(attr)
            placed[i] += 1
        elif context > 0:
            extra.append(attr)
        else:
            del e.attrs[attr]
    size = facts_per_passage + context
    groups += [extra[i : i + size] for i in range(0, len(extra), size)]
    fillers = rng.sample(FILLERS[e.kind], len(FILLERS[e.kind])) if context > 0 else []
    out = []
    for group in groups:
        sentences = [_sentence(e, attr) for attr in group]
        while len(sentences) < size and fillers:
            sentences.append(fillers.pop().format(s=e.name))
        out.append((group, f'"{e.name}"\n' + " ".join(rng.sample(sentences, len(sentences)))))
    return out


def _sentence(e: Entity, attr: str) -> str:
    value = e.attrs[attr]
    if attr in PHRASE:
        return fact_sentence(attr, e.name, value)
    return (CONTEXT[attr].template if attr in CONTEXT else TWIN_NOTE).format(s=e.name, v=value)


def hard_corpus_rows(rng: random.Random, entities: list[Entity], prefix: str, cfg) -> list[dict]:
    """Every passage of every entity as a corpus row, shuffled; sets `passage_ids` for every attribute stated."""
    passages = [(e, p) for e in entities for p in entity_passages(rng, e, cfg.facts_per_passage, cfg.context_sentences)]
    rng.shuffle(passages)
    rows = []
    for i, (e, (attrs, text)) in enumerate(passages):
        pid = f"{prefix}-{i:05d}"
        e.passage_ids.update(dict.fromkeys(attrs, pid))
        rows.append({"id": pid, "contents": text})
    return rows


# ----------------------------------------------------------------------------------------------- questions


def hard_question_pool(rng: random.Random, entities: list[Entity], paraphrase: bool, deep: bool = False):
    """hops -> every question the side's facts answer (one wording per subject and question type); with `deep` also
    the 4-6 hop chains of DEEP_QUESTIONS (drawn after the others)."""
    out: dict[int, list[dict]] = {1: [], 2: [], 3: []}
    _add_questions(rng, entities, QUESTIONS, paraphrase, out)
    if deep:
        out.update({h: [] for h in DEEP_HOPS})
        _add_questions(rng, entities, DEEP_QUESTIONS, paraphrase, out)
    return out


def _add_questions(rng: random.Random, entities: list[Entity], types: list, paraphrase: bool, out: dict) -> None:
    by_name = {e.name: e for e in entities}
    for e in entities:
        for kind, path, plain, paraphrases in types:
            if e.kind != kind:
                continue
            template = rng.choice(paraphrases) if paraphrase else plain
            chain, support = [e.name], []
            for attr in path:
                here = by_name.get(chain[-1])
                if here is None or attr not in here.attrs:
                    break
                chain.append(here.attrs[attr])
                support.append(here.passage_ids[attr])
            if len(support) < len(path):
                continue
            answer = chain[-1] if path[-1] in RELATIONS else chain.pop()
            q = question_record(template.format(s=e.name), answer, len(path), chain, support)
            out[len(path)].append({**q, "path": list(path)})


def pick_questions(rng: random.Random, pool: dict[int, list[dict]], n: int, side: str, cfg) -> list[dict]:
    """`n` questions in the configured mix of hops (a shortfall of one kind filled from the others)."""
    if n > sum(map(len, pool.values())):
        raise ValueError(
            f"toy_world: the {side} side has only {sum(map(len, pool.values()))} questions but {n} were asked for; "
            "raise toy_world.n_entities or lower n_train / n_val"
        )
    shuffled = {h: rng.sample(qs, len(qs)) for h, qs in pool.items()}
    deep = [h for h in DEEP_HOPS if h in pool]
    want = {3: round(n * cfg.three_hop_share), 2: round(n * cfg.two_hop_share)}
    want.update({h: round(n * cfg.deep_share / len(deep)) for h in deep})
    take = {h: min(len(shuffled[h]), want[h]) for h in (*deep, 3, 2)}
    take[1] = min(len(shuffled[1]), n - sum(take.values()))
    for h in (2, 3, *deep):  # fill from the longer chains when the shorter ones run short
        take[h] += min(len(shuffled[h]) - take[h], n - sum(take.values()))
    picked = [q for h in (1, 2, 3, *deep) for q in shuffled[h][: take[h]]]
    rng.shuffle(picked)
    return [{"id": f"tw-{side}-{i:04d}", **q} for i, q in enumerate(picked)]


# ----------------------------------------------------------------------------------------------- worlds


def generate_hard(cfg, rng: random.Random, pools: dict, n_val: int):
    """(entities, corpus rows, train questions, val questions) of a hard world; `rng` has drawn `pools` (the default
    world's first draws), `n_val` entities of the `n_entities` are validation ones (twins come on top)."""
    used: set[str] = set()
    sides = [side_names(rng, "train", cfg.n_entities - n_val, pools, used), side_names(rng, "val", n_val, pools, used)]
    add_twins(rng, sides, cfg.distractors, name_variants(pools, cfg.seed), used)
    entities = make_hard_sides(rng, sides, cfg.context_sentences > 0)
    corpus = hard_corpus_rows(rng, entities, "tw", cfg)
    splits = {}
    for side, n in (("train", cfg.n_train), ("val", cfg.n_val)):
        pool = hard_question_pool(rng, [e for e in entities if e.side == side], cfg.paraphrase, cfg.deep_share > 0)
        splits[side] = pick_questions(rng, pool, n, side, cfg)
    return entities, corpus, splits["train"], splits["val"]


def practice_side(rng: random.Random, cfg, pools: dict, n: int, used: set[str], prefix: str):
    """A train-like hard sub-world for demonstrations (rsearch_verl/toy/demos.py): `n` entities named from the
    world's pools (none in `used`: the world's validation names), their twins spelt with the world's variants.
    Returns (entities, passage id -> contents, hops -> questions)."""
    names = side_names(rng, "train", n, pools, used)
    add_twins(rng, [names], cfg.distractors, name_variants(pools, cfg.seed), used)
    entities = make_hard_sides(rng, [names], cfg.context_sentences > 0)
    passages = {row["id"]: row["contents"] for row in hard_corpus_rows(rng, entities, prefix, cfg)}
    return entities, passages, hard_question_pool(rng, entities, cfg.paraphrase, cfg.deep_share > 0)
