"""Checks of a toy world's invariants that the default and the harder world's tests share.

from rsearch_verl.testing.worlds import side_leaks
assert side_leaks(build_toy_world(cfg)) == []
"""

from __future__ import annotations

import re


def mentions(text: str, name: str) -> bool:
    """`name` occurs in `text` as whole words."""
    return re.search(rf"\b{re.escape(name)}\b", text) is not None


def side_leaks(world) -> list[dict]:
    """The questions of one split that name an entity of the other side (in the question or its answer), or whose
    hop chain leaves their own side: none, in a world whose held-out answers can only be found in the corpus."""
    sides = {side: [e.name for e in world.entities if e.side == side] for side in ("train", "val")}
    if not (sides["train"] and sides["val"]):
        raise AssertionError("a toy world has entities on both sides")
    leaks = []
    for split, other in (("train", "val"), ("val", "train")):
        for q in world.questions(split):
            text = q["question"] + " " + " ".join(q["golden_answers"])
            if any(mentions(text, n) for n in sides[other]) or not all(n in sides[split] for n in q["entities"]):
                leaks.append(q)
    return leaks
