"""The search object the HTTP server holds: encoder + index + corpus store, loaded from an index directory.

`load_retriever(dir)` reads `dir/manifest.json` (written last by `python -m retrieval_server build`, so its
presence means the index is complete) and opens what it names: a dense FAISS index with its encoder, or BM25, and the
whole documents (`documents.sqlite`, for POST /documents) when the index has them (indexes built before they existed
do not).

Usage:
    r = load_retriever("indexes/wiki_e5_flat", device="cuda")
    rows, scores = r.search(["who wrote hamlet"], topk=3)   # one encoder forward + one index search
    r.docs(rows[0])                       # [{"id", "contents"}, ...] (+ "doc_id" for a chunked index's passages)
    r.documents.get(["doc7"])             # {"doc7": whole contents}; r.documents is None without documents.sqlite
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from retrieval_server.bm25 import BM25_DIR, BM25Index
from retrieval_server.corpus import CorpusStore
from retrieval_server.documents import DOCUMENTS_FILE, DocumentStore
from retrieval_server.fingerprint import index_fingerprint

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CORPUS_DIR = "corpus"
MANIFEST_KEYS = ("encoder", "model_path", "pooling", "index_type", "params", "n_docs", "dim")


class Retriever:
    """Batched search over one index. `search` may run on several threads at once (the batcher's workers): the
    encoder runs under inference_mode, FAISS / bm25s searches and the memory-mapped corpus are read-only."""

    def __init__(self, manifest: dict, store: CorpusStore, index, encoder=None, documents=None) -> None:
        self.manifest = manifest
        self.store = store
        self.index = index  # DenseIndex or BM25Index: both have search(queries, k) -> (scores, rows)
        self.encoder = encoder  # None for BM25
        self.documents: DocumentStore | None = documents  # None: an index built before documents were stored
        self.n_docs = int(manifest["n_docs"])  # passages (index rows)
        self.info = {k: manifest[k] for k in ("encoder", "index_type", "n_docs", "dim")}
        self.info["chunk_tokens"] = int(manifest.get("chunk_tokens", 0))
        self.info["fingerprint"] = manifest.get("fingerprint")  # what a record / replay store is pinned to
        self.info["n_documents"] = documents.n_documents if documents is not None else None

    def search(self, queries: list[str], topk: int) -> tuple[list[list[int]], list[list[float]]]:
        """Rows and scores per query, best first; `topk` is clipped to the corpus size."""
        if not queries:
            return [], []
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        k = min(int(topk), self.n_docs)
        if self.encoder is None:
            scores, rows = self.index.search(list(queries), k)
        else:
            scores, rows = self.index.search(self.encoder.encode_queries(list(queries)), k)
        out_rows, out_scores = [], []
        for r, s in zip(rows, scores, strict=True):
            keep = r >= 0  # approximate indexes may find fewer than k
            out_rows.append([int(x) for x in r[keep]])
            out_scores.append([float(x) for x in np.asarray(s)[keep]])
        return out_rows, out_scores

    def docs(self, rows: list[int]) -> list[dict]:
        return self.store.get(rows)


def read_manifest(index_dir: str) -> dict:
    path = Path(index_dir) / MANIFEST
    if not Path(index_dir).is_dir():
        raise FileNotFoundError(f"index directory {index_dir} does not exist")
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the index in {index_dir} is incomplete (build interrupted?); "
            "rerun `python -m retrieval_server build` with the same --out to finish it"
        )
    manifest = json.loads(path.read_text())
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise ValueError(f"{path} lacks {missing}")
    return manifest


def load_retriever(index_dir: str, device: str = "cpu") -> Retriever:
    """Open the index in `index_dir` for serving; clear error when it is missing or incomplete."""
    manifest = read_manifest(index_dir)
    if "fingerprint" not in manifest:  # built before fingerprints: computed here (one pass over the corpus)
        manifest["fingerprint"] = index_fingerprint(index_dir, manifest)
    store = CorpusStore.open(str(Path(index_dir) / CORPUS_DIR))
    if len(store) != int(manifest["n_docs"]):
        raise ValueError(f"corpus store has {len(store)} passages, manifest says {manifest['n_docs']}")
    documents = _open_documents(index_dir, store)
    if manifest["index_type"] == "bm25":
        return Retriever(manifest, store, BM25Index.load(str(Path(index_dir) / BM25_DIR)), documents=documents)
    # heavy: torch / transformers and faiss, dense indexes only
    from retrieval_server.encoders import load_encoder
    from retrieval_server.index import DenseIndex

    # MiniLM ships inside a Python package: resolve it again here, the build machine's venv path may not exist.
    model_path = None if manifest["encoder"] == "minilm" else manifest["model_path"]
    encoder = load_encoder(
        manifest["encoder"],
        device=device,
        model_path=model_path,
        pooling=manifest["pooling"],
        max_length=int(manifest.get("max_length", 256)),
    )
    index = DenseIndex.load(index_dir, device=device)
    if index.ntotal != len(store):
        raise ValueError(f"index holds {index.ntotal} vectors, corpus {len(store)} passages")
    enc_name, n = manifest["encoder"], len(store)
    logger.info("loaded %s %s index over %d passages from %s", enc_name, index.index_type, n, index_dir)
    return Retriever(manifest, store, index, encoder, documents)


def _open_documents(index_dir: str, store: CorpusStore) -> DocumentStore | None:
    path = Path(index_dir) / DOCUMENTS_FILE
    if not path.exists():
        logger.info("%s has no %s (built before documents were stored): /documents answers 404", index_dir, path.name)
        return None
    return DocumentStore.open(path, store)
