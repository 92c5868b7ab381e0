"""BM25 lexical index (bm25s), saved in and loaded from the index directory, with the dense index's search shape.

Tokenisation is bm25s's default (lower-case, words of 2+ characters, English stop words removed) for passages and
queries alike; unknown query words simply score nothing.

Usage:
    idx = BM25Index.build(store.iter_contents(), k1=0.9, b=0.4); idx.save("out/bm25")
    idx = BM25Index.load("out/bm25"); scores, rows = idx.search(["who wrote hamlet"], k=3)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

BM25_DIR = "bm25"
STOPWORDS = "en"
# Pyserini's defaults, which Search-R1's BM25 baseline uses.
DEFAULT_K1 = 0.9
DEFAULT_B = 0.4


def _bm25s():
    """bm25s, its logger put back to inheriting the root's level: bm25s sets it to DEBUG when imported, so a build at
    INFO printed its debug notes."""
    import bm25s  # deferred: bm25s (scipy, jax when installed) only when a BM25 index is built or searched

    logging.getLogger("bm25s").setLevel(logging.NOTSET)
    return bm25s


def _tokenize(texts: list[str], return_ids: bool):
    bm25s = _bm25s()

    return bm25s.tokenize(texts, stopwords=STOPWORDS, return_ids=return_ids, show_progress=False)


class BM25Index:
    """A bm25s model over the corpus rows (row i = passage i of the CorpusStore)."""

    def __init__(self, model, n_docs: int) -> None:
        self.model = model
        self.n_docs = n_docs

    @classmethod
    def build(cls, text_batches: Iterable[list[str]], k1: float = DEFAULT_K1, b: float = DEFAULT_B) -> BM25Index:
        bm25s = _bm25s()

        tokens: list[list[str]] = []
        for batch in text_batches:
            tokens.extend(_tokenize(batch, return_ids=False))
        if not tokens:
            raise ValueError("BM25 index needs at least one passage")
        model = bm25s.BM25(k1=k1, b=b)
        model.index(tokens, show_progress=False)
        logger.info("BM25 index over %d passages, vocabulary %d", len(tokens), len(model.vocab_dict))
        return cls(model, len(tokens))

    def save(self, out_dir: str) -> None:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save(str(path), show_progress=False)
        (path / "n_docs.json").write_text(json.dumps({"n_docs": self.n_docs}))

    @classmethod
    def load(cls, out_dir: str) -> BM25Index:
        bm25s = _bm25s()

        path = Path(out_dir)
        if not (path / "n_docs.json").exists():
            raise FileNotFoundError(f"no BM25 index in {path}")
        model = bm25s.BM25.load(str(path), mmap=True, show_progress=False)
        return cls(model, json.loads((path / "n_docs.json").read_text())["n_docs"])

    def search(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, rows) per query, best first; k is clipped to the corpus size."""
        k = max(1, min(int(k), self.n_docs))
        if not queries:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        rows, scores = self.model.retrieve(_tokenize(queries, return_ids=False), k=k, show_progress=False)
        return np.asarray(scores, dtype=np.float32), np.asarray(rows, dtype=np.int64)
