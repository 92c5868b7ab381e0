"""The toy world's entities and how their facts are worded, shared by the default generator (world.py) and the
harder one (world_hard.py): made-up name words, the entity record, one sub-world's people, cities and regions,
and the phrase a fact is searched and stated by ("the birthplace of Kiro Baz").

Usage (through the generators; see rsearch_verl/toy/world.py for the world and its CLI):
    pools = name_pools(random.Random("toy-world-0"), 320)       # per kind, two pools of made-up words
    side = make_side(rng, "train", 224, pools, used=set())       # [Entity, ...]: regions, cities, people
    fact_key("birthplace", "Kiro Baz")                           # "the birthplace of Kiro Baz"
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

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
    passage_ids: dict[str, str] = field(default_factory=dict)  # attribute -> id of the passage stating it


def _name_words(rng: random.Random, n: int, taken: set[str]) -> list[str]:
    """`n` new distinct made-up words (2 syllables); none contains another, so word-boundary checks are exact."""
    out: list[str] = []
    for _ in range(200 * n + 10_000):
        if len(out) == n:
            break
        word = "".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(2))
        if not 4 <= len(word) <= 7 or not any(m in word for m in _EXOTIC):
            continue
        if any(word in t or t in word for t in taken):
            continue
        taken.add(word)
        out.append(word.capitalize())
    if len(out) < n:
        raise ValueError(f"toy_world: cannot make {n} more distinct names; lower toy_world.n_entities")
    return out


def variant_word(rng: random.Random, word: str, taken: set[str]) -> str:
    """A new made-up word one syllable off `word` ("Baz" -> "Bax", "Kiro" -> "Kirae"): its last vowel and what
    follows are redrawn. Like `_name_words`, it neither contains nor is contained in a word of `taken` (added to it)."""
    low = word.lower()
    cut = len(low) - 1
    while cut > 0 and low[cut] not in "aeiouy":  # back to the last vowel group
        cut -= 1
    while cut > 0 and low[cut - 1] in "aeiouy":
        cut -= 1
    for _ in range(2_000):
        new = low[:cut] + rng.choice(_NUCLEI) + rng.choice(_CODAS)
        if not 4 <= len(new) <= 7 or not any(m in new for m in _EXOTIC):
            continue
        if any(new in t or t in new for t in taken):
            continue
        taken.add(new)
        return new.capitalize()
    raise ValueError(f"toy_world: no one-syllable variant of {word!r} left; lower toy_world.n_entities")


def _kind_counts(n: int) -> dict[str, int]:
    n_regions = max(1, round(n * 0.1))
    n_cities = max(2, round(n * 0.28))
    return {"region": n_regions, "city": n_cities, "person": n - n_regions - n_cities}


def name_pools(rng: random.Random, n_entities: int) -> dict[str, tuple[list[str], list[str]]]:
    """Per kind, two pools of made-up words; a name is one word of each ("Kiro Baz"). Both sides draw from the
    same pools (each word names train AND val entities), and the pools of different kinds are disjoint, so a word
    says what it names. With one token per pool word (toy_tokenizer), writing a held-out name into a query or an
    answer is a copy of tokens the policy has seen, never the recall of a name it has not."""
    taken: set[str] = set()
    pools = {}
    for kind, count in _kind_counts(n_entities).items():
        size = max(3, math.isqrt(3 * count) + 1)  # >= 3x more combinations than names
        pools[kind] = (_name_words(rng, size, taken), _name_words(rng, size, taken))
    return pools


def draw_names(rng: random.Random, kind: str, n: int, pools: dict, used: set[str]) -> list[str]:
    """`n` unused names of `kind`. Once the train side has names, only words it already uses are combined (when
    there are enough such combinations), so every word of a val name also occurs in train names."""
    first, second = pools[kind]
    seen = {w for name in used for w in name.split()}
    free = [f"{a} {b}" for a in first for b in second if f"{a} {b}" not in used]
    known = [c for c in free if set(c.split()) <= seen]
    if used and len(known) >= n:
        free = known
    if len(free) < n:
        raise ValueError(f"toy_world: not enough {kind} names; lower toy_world.n_entities")
    picked = rng.sample(free, n)
    used.update(picked)
    return picked


def side_counts(n: int, side: str) -> dict[str, int]:
    counts = _kind_counts(n)
    if counts["person"] < 3:
        raise ValueError(f"toy_world.n_entities: too few entities for the {side} side ({n}); use >= 20 in all")
    return counts


def make_side(rng: random.Random, side: str, n: int, pools: dict, used: set[str]) -> list[Entity]:
    """One disconnected sub-world: relations never leave it."""
    counts = side_counts(n, side)
    return populate(rng, side, lambda kind: draw_names(rng, kind, counts[kind], pools, used))


def populate(rng: random.Random, side: str, names: Callable[[str], list[str]]) -> list[Entity]:
    """The regions, cities and people called `names(kind)`, with their facts; relations stay among them. `names` is
    called once per kind, in the order region, city, person, between the draws of the facts (the default world's
    random stream depends on that order)."""
    regions = [Entity(w, "region", side, {"emblem": rng.choice(ANIMALS)}) for w in names("region")]
    cities = [
        Entity(w, "city", side, {"region": rng.choice(regions).name, "founded": str(rng.randint(900, 1600))})
        for w in names("city")
    ]
    people: list[Entity] = []
    for name in names("person"):
        attrs = {
            "birthplace": rng.choice(cities).name,
            "born": str(rng.randint(1700, 1950)),
            "profession": rng.choice(PROFESSIONS),
            "colour": rng.choice(COLOURS),
        }
        # Mentors come from earlier people, so the mentor graph is a forest (no cycles); most people have one.
        if people and rng.random() < 0.85:
            attrs["mentor"] = rng.choice(people).name
        people.append(Entity(name, "person", side, attrs))
    return regions + cities + people


# How a fact names its attribute; passages, search queries and thoughts all use these phrases.
PHRASE = {
    "birthplace": "the birthplace", "born": "the birth year", "profession": "the profession",
    "colour": "the favourite colour", "mentor": "the mentor", "region": "the region",
    "founded": "the founding year", "emblem": "the emblem animal",
}  # fmt: skip


def fact_key(attr: str, name: str) -> str:
    """What one searches for to find a fact: "the birthplace of Kiro Baz"."""
    return f"{PHRASE[attr]} of {name}"


def fact_sentence(attr: str, name: str, value: str) -> str:
    key = fact_key(attr, name)
    return f"{key[0].upper()}{key[1:]} is {value}."


def question_record(text: str, answer: str, hops: int, chain: list[str], support: list[str]) -> dict:
    return {
        "question": text,
        "golden_answers": [answer],
        "data_source": f"toy_world_{hops}hop",
        "hops": hops,
        "entities": chain,
        "support": support,
    }
