"""Synthetic, deliberately imperfect demonstrations of the toy world, for the warm-start SFT stage.

Demonstrations are written on *practice* sub-worlds (`practice_sides`): drawn like the toy world's train side, from
the same name words, but with new name combinations and new facts, and never a validation entity. A fact is
demonstrated about once, so a policy cannot lower its SFT loss by memorising question -> answer: it has to copy
names from the question into its search and the answer out of the retrieved passage, which is what transfers to
held-out entities. Each demonstration follows its protocol's `demo_format` (rsearch_verl/rollout/protocols/, checked
with the protocol's own parser). On a harder world (rsearch_verl/toy/world_hard.py) the practice worlds come from
its generator (twins, multi-sentence passages, paraphrased 1- to 3-hop questions) and are searched with the retrieval
server's BM25 index; a demonstration still searches each hop's fact by its key, whatever the question's wording.

Usage:
    from rsearch_verl.toy.demos import demonstrations
    demos = demonstrations(world, "search_r1", n=1024, seed=0, p_no_search=0.5, topk=1)
    # [{"prompt", "segments": [(role, text), ...], "answer", "question", "searched"}, ...]
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import random
from dataclasses import dataclass, field

from rsearch_verl.segments import OBSERVATION, POLICY
from rsearch_verl.toy.entities import (
    ANIMALS,
    COLOURS,
    PHRASE,
    PROFESSIONS,
    Entity,
    fact_key,
    fact_sentence,
    make_side,
    name_pools,
)
from rsearch_verl.toy.world import ONE_HOP, TWO_HOP, World, corpus_rows, n_val_entities, question_pool
from rsearch_verl.toy.world_hard import practice_side, uses_hard_generator


def _run_sync(make_coro):
    """Run a coroutine from sync code, also when the caller already runs an event loop (then in a thread)."""

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make_coro())).result()


def practice_search(side: PracticeSide, rng: random.Random):
    """A SearchFn over a practice side's passages that looks like the retriever. The default world's: the fact whose
    key ("the region of Tul Vex") is the query first, then random other passages (a search there finds its fact or
    nothing). A harder world's (`side.bm25`): the retrieval server's own BM25 index over the side's passages, so a
    demonstration sees what a search really returns there: twins, the entity's other passages, misses."""
    # deferred: the search package (httpx and more) stays out of the light toy world's import
    from rsearch_verl.search.types import Doc

    if side.bm25:
        return _bm25_search(side.passages)
    passages = side.passages
    ids = sorted(passages)
    by_key = {fact_key(attr, e.name).lower(): pid for e in side.entities for attr, pid in e.passage_ids.items()}

    async def search(queries: list[str], topk: int, source: str = "local") -> list[list[Doc]]:
        out = []
        for query in queries:
            hit = by_key.get(query.lower().strip())
            hits = [hit] if hit else []
            hits += [pid for pid in rng.sample(ids, min(len(ids), topk + 1)) if pid not in hits]
            out.append([Doc(pid, passages[pid], score=1.0 - 0.1 * i) for i, pid in enumerate(hits[:topk])])
        return out

    return search


def _bm25_search(passages: dict[str, str]):
    """A SearchFn over `passages` with the retrieval server's BM25 index class (bm25s; its tokenizer, k1 and b)."""
    # deferred: bm25 (numpy) and the search package stay out of the light toy world's import
    from retrieval_server.bm25 import BM25Index
    from rsearch_verl.search.types import Doc

    ids = sorted(passages)
    index = BM25Index.build([[passages[pid] for pid in ids]])

    async def search(queries: list[str], topk: int, source: str = "local") -> list[list[Doc]]:
        scores, rows = index.search(list(queries), k=topk)
        return [
            [Doc(ids[int(r)], passages[ids[int(r)]], score=float(x)) for r, x in zip(row, xs, strict=True)]
            for row, xs in zip(rows, scores, strict=True)
        ]

    return search


def _guess(entities: list[Entity], rng: random.Random, q: dict) -> str:
    """A plausible but usually wrong answer of the right type (what a model answering from memory says)."""
    answer = q["golden_answers"][0]
    if answer.isdigit():
        return str(int(answer) + rng.choice([-30, -7, -1, 1, 12, 45]))
    for pool in (PROFESSIONS, COLOURS, ANIMALS):
        if answer in pool:
            return rng.choice(pool)
    kind = next(e.kind for e in entities if e.name == answer)
    return rng.choice([e.name for e in entities if e.kind == kind])


def _plan(q: dict) -> str:
    """The first thought names the fact to search first and, for 2 or 3 hops, the ones after it ("Next, the region of
    it."), so later decisions (one more hop? which fact?) are copies of the policy's own earlier text. It names the
    facts as the passages do, whatever the question's wording: the reformulation a paraphrased question needs."""
    attrs, subject = question_attrs(q), q["entities"][0]
    if q["hops"] == 1:
        return f"I need {fact_key(attrs[0], subject)}."
    if q["hops"] == 2:
        return f"I need {fact_key(attrs[0], subject)}. Next, {PHRASE[attrs[1]]} of it."
    return f"I need {fact_key(attrs[0], subject)}. Next, {PHRASE[attrs[1]]} of it, then {PHRASE[attrs[2]]} of that."


def _final_thought(q: dict) -> str:
    """Restates the retrieved fact, so the answer is copied from a sentence that names what it is."""
    attr, subject = question_attrs(q)[-1], q["entities"][q["hops"] - 1]
    return fact_sentence(attr, subject, q["golden_answers"][0])


def _search_segments(proto, q: dict, search, topk: int) -> list[tuple[str, str]] | None:
    """One (search turn, observation) pair per hop, each searching the hop's fact by its key; None when a search
    misses its hop's passage (a real index can), as a demonstration must read the fact it restates."""
    think, call, _ = proto.demo_format
    attrs = question_attrs(q)
    segments: list[tuple[str, str]] = []
    found: list[str] = []

    async def recorded(queries: list[str], k: int, source: str = "local"):
        docs = await search(queries, k, source)
        found.extend(d.id for row in docs for d in row)
        return docs

    for hop in range(q["hops"]):
        subject = q["entities"][hop]
        if hop == 0:
            thought = _plan(q)
        else:  # the last hop's fact restated, then the next hop's key
            before = q["entities"][hop - 1]
            thought = f"{fact_sentence(attrs[hop - 1], before, subject)} Next, {fact_key(attrs[hop], subject)}."
        turn = think.format(t=thought) + call.format(q=fact_key(attrs[hop], subject))
        action = proto.parse_turn(turn)
        if action.kind != "search" or not action.queries:
            raise ValueError(f"demonstrations: protocol {proto.name!r} does not parse the search turn {turn!r}")
        obs = _run_sync(lambda a=action: proto.observe(a, recorded, topk))
        if q["support"][hop] not in found:
            return None
        segments += [("policy", turn), ("observation", obs)]
    return segments


def _guess_segments(fmt, answer: str) -> list[tuple[str, str]]:
    """An answer from "memory": the decision and the answer tags are policy text, the guessed value itself is a
    "guess" segment -- context, not a target in SFT. Were the guesses trained, the answer slot would learn to emit
    a random name half of the time, which competes with copying the answer out of the thought (copying into the
    answer is the last skill to appear, see docs/toy_world_learning.md); untrained, a no-search answer is whatever
    the policy makes of it, which is rarely right -- an answer from memory about a fictional entity."""
    head = fmt[0].format(t="I think I know this without searching.")
    return _answer_segments(head + fmt[2].format(a=answer), answer, len(head), "guess")


def _answer_segments(text: str, answer: str, start: int, role: str) -> list[tuple[str, str]]:
    """`text` (a final turn) as policy text around the answer value, which gets `role` ("answer": a target;
    "guess": no target). The cut falls before the space that precedes the
    value, so byte-level BPE tokenises the pieces exactly as it would the whole turn."""
    begin = text.index(answer, start)
    cut = begin - 1 if text[begin - 1] == " " else begin
    end = begin + len(answer)
    return [("policy", text[:cut]), (role, text[cut:end]), ("policy", text[end:])]


def question_attrs(q: dict) -> list[str]:
    """The attribute asked at each hop: the question's `path` (harder worlds), else recovered from the templates."""
    if "path" in q:
        return list(q["path"])
    for kind in ONE_HOP:
        for template, attr in ONE_HOP[kind]:
            if q["hops"] == 1 and template.format(s=q["entities"][0]) == q["question"]:
                return [attr]
        for template, rel, attr in TWO_HOP[kind]:
            if q["hops"] == 2 and template.format(s=q["entities"][0]) == q["question"]:
                return [rel, attr]
    raise ValueError(f"demonstrations: {q['question']!r} matches no toy-world template")


NOTE_FORM = 2  # the wording of hop_notes, in the summary warm start's cache key (1: every fact found, restated)


def hop_notes(q: dict) -> list[str]:
    """The note a summary fold writes after k hops were found, for k = 0 .. hops (MEM1-style state, not a transcript):
    the newest fact and what is left of the chain, the question rewritten around the newest entity ("The mentor of
    Kiro Baz is Tul Vex. Left: the region of the birthplace of Tul Vex."). Each note is a few local copies (the newest
    fact from the observation just read, the rest of the chain from the note before with one link fewer) and stays
    short at any depth: a note restating every fact found was a long copy among near-twin names that the one-head toy
    policy got wrong more often with each fold (docs/long_horizon.md)."""
    attrs, chain = question_attrs(q), list(q["entities"]) + q["golden_answers"][:1]
    notes = []
    for k in range(q["hops"] + 1):
        left = "nothing." if k == q["hops"] else fact_key(attrs[k], chain[k]) + "."
        for attr in attrs[k + 1 :]:
            left = f"{PHRASE[attr]} of {left}"
        found = fact_sentence(attrs[k - 1], chain[k - 1], chain[k]) + " " if k else ""
        notes.append(f"{found}Left: {left}")
    return notes


def _evidence(passages: dict[str, str], proto, q: dict) -> str:
    """The protocol's evidence before its answer (R-Search: the supporting passages' text, unmodified), or ""."""
    if not proto.demo_evidence:
        return ""
    return proto.demo_evidence.format(e=" ".join(passages[pid].split("\n", 1)[1] for pid in q["support"]))


@dataclass
class PracticeSide:
    """A fresh train-like sub-world for demonstrations: same name words, new combinations and facts."""

    entities: list[Entity]
    passages: dict[str, str]
    one_hop: list[dict]
    two_hop: list[dict]
    three_hop: list[dict] = field(default_factory=list)
    bm25: bool = False  # practice_search: a real BM25 index (harder worlds) rather than the exact-key lookup
    deep: list[dict] = field(default_factory=list)  # 4-6 hop chains (the deep world)

    def pick(self, rng: random.Random, two_share: float, three_share: float, deep_share: float = 0.0) -> dict:
        """A question, 2-, 3- or 4-6 hop with the given chances (one draw; none when there are only 1-hop ones)."""
        if not self.two_hop and not self.three_hop:
            return rng.choice(self.one_hop)
        r = rng.random()
        if r < two_share and self.two_hop:
            return rng.choice(self.two_hop)
        if two_share <= r < two_share + three_share and self.three_hop:
            return rng.choice(self.three_hop)
        if two_share + three_share <= r < two_share + three_share + deep_share and self.deep:
            return rng.choice(self.deep)
        return rng.choice(self.one_hop)


def practice_sides(world: World, n_sides: int, seed: int) -> list[PracticeSide]:
    """`n_sides` sub-worlds drawn like the train side (the world's own name pools; no val name ever used), each
    with new relations and attribute values. Demonstrations come from these, not from the train questions: a fact
    is demonstrated about once, so the warm start cannot lower its loss by memorising question -> answer and has
    to learn to copy the answer out of the retrieved passage, which is what transfers to held-out entities."""
    cfg = world.cfg
    pools = name_pools(random.Random(f"toy-world-{cfg.seed}"), cfg.n_entities)  # generate()'s first draws
    val_names = {e.name for e in world.entities if e.side == "val"}
    n_side = sum(e.side == "train" for e in world.entities)
    sides = []
    for k in range(n_sides):
        rng = random.Random(f"practice-{seed}-{k}")
        if uses_hard_generator(cfg):  # twins on top of the train side's own entities, as in the world
            n_own = cfg.n_entities - n_val_entities(cfg)
            entities, passages, by_hops = practice_side(rng, cfg, pools, n_own, set(val_names), f"practice-{k}")
            deep = [q for h in sorted(by_hops) if h > 3 for q in by_hops[h]]
            sides.append(PracticeSide(entities, passages, by_hops[1], by_hops[2], by_hops[3], bm25=True, deep=deep))
            continue
        entities = make_side(rng, "train", n_side, pools, set(val_names))
        passages = {row["id"]: row["contents"] for row in corpus_rows(rng, entities, f"practice-{k}")}
        one, two = question_pool(entities)
        sides.append(PracticeSide(entities, passages, one, two))
    return sides


def _demo_protocol(protocol_name: str, tokenizer, variant: str):
    """The paper's protocol as the demonstration format writes it (default kwargs) and its demo format."""
    # deferred: the rollout protocols stay out of the light toy world's import
    from rsearch_verl.rollout.protocols import get_protocol

    proto = get_protocol(protocol_name)
    fmt = getattr(proto, "demo_format", None)
    if fmt is None:
        raise ValueError(f"demonstrations: protocol {protocol_name!r} has no demo_format")
    if tokenizer is not None:
        proto.bind_tokenizer(tokenizer, chat=variant == "instruct")
    return proto, fmt


def demonstrations(
    world: World,
    protocol_name: str,
    n: int,
    seed: int,
    p_no_search: float = 0.5,
    variant: str = "base",
    topk: int = 3,
    tokenizer=None,
) -> list[dict]:
    """Synthetic, deliberately imperfect demonstrations for a warm-start SFT stage, on practice sub-worlds
    (`practice_sides`: train-like entities, never a val one), in the world's mix of hops.

    With probability `p_no_search` the demonstration answers at once from "memory" (a guess of the right type,
    usually wrong); otherwise it searches each hop's entity, sees the protocol's real observation of
    retrieved-looking passages and answers correctly. Returns dicts {"prompt", "segments": [(role, text)],
    "answer", "question", "searched"}; role is "policy", "observation", "answer" (the value of a searched answer: a
    target) or "guess" (the value of a from-memory answer: context only). `tokenizer`: the policy's, for protocols
    whose observations follow its chat template (tool_call with `variant="instruct"`), as the rollouts' do.
    """
    proto, fmt = _demo_protocol(protocol_name, tokenizer, variant)
    rng = random.Random(f"demos-{seed}-{protocol_name}")
    sides = practice_sides(world, max(1, math.ceil(n / 150)), seed)
    searches = [practice_search(side, rng) for side in sides]
    out = []
    shares = (world.cfg.two_hop_share, world.cfg.three_hop_share, world.cfg.deep_share)
    for _ in range(20 * n):  # a search misses its fact rarely (harder worlds); never forever
        if len(out) == n:
            break
        k = rng.randrange(len(sides))
        side = sides[k]
        q = side.pick(rng, *shares)
        searched = rng.random() >= p_no_search
        if searched:
            segments = _search_segments(proto, q, searches[k], topk)
            if segments is None:
                continue  # a search missed its fact: another question
            answer = q["golden_answers"][0]
            final = fmt[0].format(t=_final_thought(q)) + _evidence(side.passages, proto, q)
            segments += _answer_segments(final + fmt[2].format(a=answer), answer, len(final), "answer")
        else:
            answer = _guess(side.entities, rng, q)
            segments = _guess_segments(fmt, answer)
        # "answer" / "guess" segments are text the policy writes (roles for the SFT loss weights): policy text here
        got = proto.extract_answer([(OBSERVATION if role == OBSERVATION else POLICY, t) for role, t in segments])
        if got is None or got.strip() != answer:
            raise ValueError(f"demonstrations: protocol {protocol_name!r} extracts {got!r}, wanted {answer!r}")
        prompt = proto.build_prompt(q["question"], variant)
        out.append(
            {"prompt": prompt, "segments": segments, "answer": answer, "question": q["question"], "searched": searched,
             "notes": hop_notes(q)}
        )  # fmt: skip
    if len(out) < n:
        raise ValueError(f"demonstrations: only {len(out)} of {n} after {20 * n} draws (searches miss their facts)")
    return out
