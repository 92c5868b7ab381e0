"""The passage corpus on disk, and a synthetic corpus with planted answers for tests and benchmarks.

A corpus is JSONL, one passage per line: `{"id": str, "contents": "\"Title\"\ntext"}` (FlashRAG / Search-R1 format).
`CorpusStore.build(corpus_jsonl, out_dir)` converts it once into two files that are memory-mapped when served:

    contents.bin   the passages' JSON records (utf-8) back to back
    offsets.npy    int64 [n + 1]; passage i is contents.bin[offsets[i]:offsets[i + 1]]

so a 21M-passage Wikipedia costs no per-passage Python object and almost no resident memory until read. A chunked
build (`build --chunk-tokens N`, retrieval_server/documents.py) writes its passages with `CorpusStore.write`; their
records carry a `doc_id` too, which /retrieve passes on.

Usage:
    store = CorpusStore.build("wiki.jsonl", "index/corpus")   # or CorpusStore.open("index/corpus")
    store.get([3, 17])  # -> [{"id": ..., "contents": ...}, ...]
    pairs = make_synthetic_corpus("toy.jsonl", 2000)  # [(query, relevant_doc_id), ...]
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import random
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

CONTENTS = "contents.bin"
OFFSETS = "offsets.npy"  # written last: its presence means the store is complete


class CorpusStore:
    """Read-only, memory-mapped passages addressed by row number (the row is the index's vector id)."""

    def __init__(self, contents: mmap.mmap | bytes, offsets: np.ndarray, path: str) -> None:
        self._contents = contents
        self._offsets = offsets
        self.path = path

    @classmethod
    def build(cls, corpus_jsonl: str, out_dir: str) -> CorpusStore:
        """Stream `corpus_jsonl` into `out_dir` (skipped when already complete) and open it."""
        if (Path(out_dir) / OFFSETS).exists():
            return cls.open(out_dir)
        return cls.write((rec for _, rec in read_corpus(corpus_jsonl)), out_dir, corpus_jsonl)

    @classmethod
    def write(cls, passages: Iterable[dict], out_dir: str, source: str = "the corpus") -> CorpusStore:
        """Write `passages` (JSON-able dicts, `{"id", "contents"}` and maybe more keys) as the store in `out_dir`,
        replacing one that is there, and open it."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / OFFSETS).unlink(missing_ok=True)  # incomplete from here until the new offsets are in place
        offsets = array("q", [0])
        pos = 0
        with open(out / CONTENTS, "wb") as dst:
            for rec in passages:
                data = json.dumps(rec, ensure_ascii=False).encode("utf-8")
                dst.write(data)
                pos += len(data)
                offsets.append(pos)
        if len(offsets) == 1:
            raise ValueError(f"corpus {source} holds no passages")
        tmp = out / (OFFSETS + ".tmp.npy")
        np.save(tmp, np.frombuffer(offsets, dtype=np.int64))
        os.replace(tmp, out / OFFSETS)
        logger.info("corpus store: %d passages, %.1f MB in %s", len(offsets) - 1, pos / 1e6, out)
        return cls.open(out_dir)

    @classmethod
    def open(cls, out_dir: str) -> CorpusStore:
        out = Path(out_dir)
        if not (out / OFFSETS).exists():
            raise FileNotFoundError(f"no complete corpus store in {out} (missing {OFFSETS}); build the index again")
        offsets = np.load(out / OFFSETS, mmap_mode="r")
        with open(out / CONTENTS, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size != int(offsets[-1]):
                raise ValueError(f"{out / CONTENTS} has {size} bytes, offsets say {int(offsets[-1])}: store corrupt")
            contents = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        return cls(contents, offsets, str(out))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def get(self, rows: list[int]) -> list[dict]:
        """Passages at `rows` (any order, repeats allowed) as `{"id", "contents"}` dicts."""
        n = len(self)
        out = []
        for r in rows:
            r = int(r)
            if not 0 <= r < n:
                raise IndexError(f"row {r} out of range for a corpus of {n} passages")
            out.append(json.loads(self._contents[int(self._offsets[r]) : int(self._offsets[r + 1])]))
        return out

    def iter_contents(self, batch: int = 4096):
        """Yield lists of passage texts in row order (for encoding and BM25), `batch` at a time."""
        for start in range(0, len(self), batch):
            yield [d["contents"] for d in self.get(list(range(start, min(start + batch, len(self)))))]


def read_corpus(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, `{"id", "contents"}`) for each non-blank line of a JSONL corpus; ValueError naming a bad line."""
    with open(path, encoding="utf-8") as src:
        for lineno, line in enumerate(src, 1):
            if line.strip():
                yield lineno, _parse_line(line, path, lineno)


def _parse_line(line: str, path: str, lineno: int) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from exc
    if not isinstance(rec, dict) or "contents" not in rec:
        raise ValueError(f"{path}:{lineno}: expected an object with 'contents' (and 'id')")
    contents = rec["contents"]
    if "title" in rec and "text" in rec and not contents:  # title/text variants of the same corpora
        contents = f'"{rec["title"]}"\n{rec["text"]}'
    return {"id": str(rec.get("id", lineno - 1)), "contents": str(contents)}


_SYL = ["ka", "lo", "ri", "ven", "tor", "mi", "sa", "dru", "bel", "nox", "qua", "zen", "pha", "gor", "lin", "ves"]
_ADJ = ["ancient", "coastal", "volcanic", "frozen", "remote", "busy", "sacred", "ruined", "floating", "hidden"]
_KIND = ["city", "river", "mountain", "monastery", "island", "fortress", "village", "lake", "desert", "forest"]
_PLACE = ["Norway", "Peru", "Kenya", "Japan", "Chile", "Egypt", "Canada", "India", "Greece", "Brazil", "Mongolia"]
_THING = [
    "copper mines",
    "silk weaving",
    "glass bells",
    "salt caravans",
    "tea gardens",
    "stone bridges",
    "wolf legends",
    "marble statues",
    "river festivals",
    "clockmakers",
    "paper lanterns",
    "horse races",
    "olive groves",
    "star charts",
]


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYL) for _ in range(rng.randint(3, 4))).capitalize()


def make_synthetic_corpus(path: str, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Write `n` passages to `path` (JSONL) and return one `(query, relevant_doc_id)` pair per passage.

    Every passage describes a made-up entity with a unique name and a random mix of attributes; its query names
    the entity and two attributes, so both lexical (BM25) and dense (MiniLM) retrieval should rank it first.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    names: set[str] = set()
    pairs = []
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            name = _name(rng)
            while name in names:
                name = _name(rng)
            names.add(name)
            adj, kind, place = rng.choice(_ADJ), rng.choice(_KIND), rng.choice(_PLACE)
            t1, t2 = rng.sample(_THING, 2)
            text = (
                f"{name} is a {adj} {kind} in {place}. It is famous for its {t1} and its {t2}. "
                f"Visitors to {name} often mention the {rng.choice(_THING)}."
            )
            doc_id = f"doc{i}"
            fh.write(json.dumps({"id": doc_id, "contents": f'"{name}"\n{text}'}) + "\n")
            pairs.append((f"which {kind} in {place} called {name} is famous for {t1}?", doc_id))
    return pairs
