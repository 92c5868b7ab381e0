"""Build an index directory from a JSONL corpus: corpus store, embeddings in resumable chunks, FAISS or BM25.

    python -m retrieval_server build --corpus wiki.jsonl --encoder e5 --index-type ivfpq --out indexes/wiki \
        --device cuda --batch-size 512 --rerank-factor 4
    python -m retrieval_server build --corpus docs.jsonl --encoder bm25 --out indexes/docs --chunk-tokens 128

`--chunk-tokens N` (N > 0) treats each corpus line as a whole document and indexes passages of at most N words of it
(ids `<doc id>#<k>`, each knowing its `doc_id`: retrieval_server/documents.py); 0, the default, indexes each line as
one passage, exactly as before chunking existed.

Layout of `--out`:

    corpus/             CorpusStore (contents.bin + offsets.npy) of the passages; [chunking.json] when chunked
    documents.sqlite    the whole documents, for POST /documents (retrieval_server/documents.py)
    emb/chunk_NNNNN.npy fp16 passage embeddings, `chunk_size` rows each, each written atomically
    index.faiss, index_params.json, [vectors.f16.npy]   or   bm25/
    manifest.json       written LAST and atomically: its presence means "index complete"

An interrupted build resumes where it stopped: finished chunks are skipped. Rerunning over a complete index only
rebuilds the (cheap) FAISS part from the chunks. Python API: `build_index(corpus, encoder, index_type, out, **params)`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from retrieval_server.bm25 import BM25_DIR, DEFAULT_B, DEFAULT_K1, BM25Index
from retrieval_server.corpus import OFFSETS, CorpusStore, read_corpus
from retrieval_server.documents import DOCUMENTS_FILE, DocumentWriter, chunk_document
from retrieval_server.fingerprint import index_fingerprint
from retrieval_server.index import INDEX_TYPES, DenseIndex
from retrieval_server.retriever import CORPUS_DIR, MANIFEST

logger = logging.getLogger(__name__)

EMB_DIR = "emb"
CHUNKING_FILE = "chunking.json"  # in corpus/: the --chunk-tokens its passages were cut with (absent: 0)
DEFAULT_CHUNK = 100_000


ENCODER_NAMES = ("e5", "bge", "minilm", "bm25")  # the families of retrieval_server/encoders.py, and BM25


def encoder_arg(value: str) -> str:
    """--encoder: a known name or an existing directory, checked before any work (a typo such as `minlm` used to
    end in a hub-download traceback that never named it, after the output directory was made)."""
    if value in ENCODER_NAMES or os.path.isdir(value):
        return value
    close = difflib.get_close_matches(value, ENCODER_NAMES, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise argparse.ArgumentTypeError(
        f"{value!r}{hint} is neither one of {', '.join(ENCODER_NAMES)} nor a local encoder directory"
    )


def corpus_arg(value: str) -> str:
    if not os.path.isfile(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a file (a JSONL corpus, one passage per line)")
    return value


def add_build_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", required=True, type=corpus_arg, help='JSONL corpus: {"id", "contents"} per line')
    parser.add_argument(
        "--encoder", required=True, type=encoder_arg, help="e5 | bge | minilm | bm25 | PATH to a local HF encoder"
    )
    parser.add_argument("--index-type", default="flat", choices=INDEX_TYPES, help="ignored for bm25")
    parser.add_argument("--out", required=True, help="index directory (resumes when it exists)")
    parser.add_argument("--encoder-path", default=None, help="weights for e5/bge (default: the hub names)")
    parser.add_argument("--pooling", default=None, choices=["mean", "cls"], help="override the family's pooling")
    parser.add_argument("--batch-size", type=int, default=64, help="encoder batch size")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK, help="passages per embedding chunk file")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-length", type=int, default=256, help="encoder max tokens per passage")
    parser.add_argument("--hnsw-m", type=int, default=None)
    parser.add_argument("--ef-search", type=int, default=None)
    parser.add_argument("--nlist", type=int, default=None)
    parser.add_argument("--pq-m", type=int, default=None)
    parser.add_argument("--nprobe", type=int, default=None)
    parser.add_argument("--rerank-factor", type=int, default=None, help="> 1: exact re-rank from fp16 on disk")
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=0,
        help="> 0: each corpus line is a document, indexed as passages of at most this many whitespace words "
        "(ids <doc id>#<k>); 0 = one passage per line (default)",
    )


def run_build(args: argparse.Namespace) -> str:
    """CLI entry: build the index described by `args`; returns the output directory."""
    params = ("hnsw_m", "ef_search", "nlist", "pq_m", "nprobe", "rerank_factor")  # None: the index type's default
    options = ("encoder_path", "pooling", "batch_size", "chunk_size", "device", "max_length", "chunk_tokens")
    kwargs = {k: getattr(args, k) for k in options}
    kwargs |= {k: getattr(args, k) for k in params if getattr(args, k) is not None}
    return build_index(args.corpus, args.encoder, args.index_type, args.out, **kwargs)


def build_index(
    corpus: str,
    encoder,
    index_type: str,
    out: str,
    *,
    encoder_path: str | None = None,
    pooling: str | None = None,
    batch_size: int = 64,
    chunk_size: int = DEFAULT_CHUNK,
    device: str = "cpu",
    max_length: int = 256,
    chunk_tokens: int = 0,
    **params,
) -> str:
    """Build `out` from `corpus`. `encoder` is a name / path ("bm25" for BM25) or a loaded `Encoder`; `chunk_tokens`
    > 0 indexes passages of at most that many words of each document (corpus line), 0 one passage per line."""
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0, got {chunk_tokens}")
    t0 = time.perf_counter()
    out_dir = Path(out)
    with _removed_if_failed(out_dir):
        _check_chunking(out_dir, chunk_tokens)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / MANIFEST).unlink(missing_ok=True)  # from here on the directory is "incomplete" until we finish
        store = _build_corpus(corpus, out_dir, chunk_tokens)
        if encoder == "bm25":
            manifest = _build_bm25(store, out_dir, params)
        else:
            if isinstance(encoder, str):
                from retrieval_server.encoders import load_encoder  # heavy: torch + transformers, dense indexes only

                encoder = load_encoder(encoder, device, encoder_path, pooling, max_length, batch_size)
            _warn_if_truncated(chunk_tokens, encoder.max_length)
            chunks = _encode_chunks(store, encoder, out_dir / EMB_DIR, chunk_size)
            manifest = _build_dense(chunks, encoder.dim, index_type, out_dir, len(store), params)
            manifest.update(
                encoder=encoder.name,
                model_path=encoder.model_path,
                pooling=encoder.pooling,
                max_length=encoder.max_length,
            )
        manifest.update(n_docs=len(store), build_s=round(time.perf_counter() - t0, 1))
        if chunk_tokens:  # absent = 0: an unchunked index's manifest (and fingerprint) stay what they were
            manifest["chunk_tokens"] = chunk_tokens
        manifest["fingerprint"] = index_fingerprint(str(out_dir), manifest)  # GET /health reports it
        _write_json_atomic(out_dir / MANIFEST, manifest)
        logger.info("index complete: %s (%d docs, %.0f s)", out_dir, len(store), time.perf_counter() - t0)
        return str(out_dir)


@contextlib.contextmanager
def _removed_if_failed(out_dir: Path):
    """A build that fails in a directory it made, before any embedding chunk is finished (a failed encoder load, a bad
    corpus line), leaves no directory behind: nothing in it would save work on the next try. One with finished chunks
    stays, for the next run to resume from."""
    created = not out_dir.exists()
    try:
        yield
    except BaseException:
        if created and not any((out_dir / EMB_DIR).glob("*.npy")):
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _check_chunking(out_dir: Path, chunk_tokens: int) -> None:
    """Refuse to resume a directory whose passages were cut differently: its embedding chunks (and corpus store)
    would be reused for passages they do not belong to."""
    store_dir = out_dir / CORPUS_DIR
    if not store_dir.is_dir():
        return
    marker = store_dir / CHUNKING_FILE
    before = json.loads(marker.read_text())["chunk_tokens"] if marker.exists() else 0
    if before != chunk_tokens:
        raise ValueError(
            f"{out_dir} holds an index built with --chunk-tokens {before}, not {chunk_tokens}: "
            "build into a new --out (or delete that directory)"
        )


def _build_corpus(corpus: str, out_dir: Path, chunk_tokens: int) -> CorpusStore:
    """The passage store (corpus/) and documents.sqlite, written together in one pass over the corpus (skipped when
    both are complete: a resumed build)."""
    store_dir, db_path = out_dir / CORPUS_DIR, out_dir / DOCUMENTS_FILE
    if (store_dir / OFFSETS).exists() and db_path.exists():
        return CorpusStore.open(str(store_dir))
    if chunk_tokens:
        store_dir.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(store_dir / CHUNKING_FILE, {"chunk_tokens": chunk_tokens})

    with DocumentWriter(db_path, chunk_tokens) as writer:

        def passages():
            row = 0
            for lineno, rec in read_corpus(corpus):
                parts = chunk_document(rec, chunk_tokens) if chunk_tokens else [rec]
                writer.add(rec, row, len(parts), where=f"{corpus}:{lineno}")
                row += len(parts)
                yield from parts

        store = CorpusStore.write(passages(), str(store_dir), corpus)
    logger.info("%d documents, %d passages (chunk_tokens=%d)", writer.n_documents, len(store), chunk_tokens)
    return store


def _warn_if_truncated(chunk_tokens: int, max_length: int) -> None:
    # ~1.3 subword tokens per English word, plus the title: longer passages lose their tail to the encoder's cut
    if chunk_tokens and chunk_tokens * 1.3 > max_length:
        logger.warning(
            "--chunk-tokens %d words is about %d encoder tokens, over --max-length %d: passage tails are not encoded "
            "(use --chunk-tokens <= %d or a larger --max-length)",
            chunk_tokens,
            int(chunk_tokens * 1.3),
            max_length,
            int(max_length / 1.3),
        )


def _build_bm25(store: CorpusStore, out_dir: Path, params: dict) -> dict:
    k1, b = float(params.pop("k1", DEFAULT_K1)), float(params.pop("b", DEFAULT_B))
    if params:
        raise ValueError(f"BM25 takes only k1 and b, got {sorted(params)}")
    BM25Index.build(store.iter_contents(), k1=k1, b=b).save(str(out_dir / BM25_DIR))
    params = {"k1": k1, "b": b}
    return {"encoder": "bm25", "model_path": None, "pooling": None, "index_type": "bm25", "params": params, "dim": 0}


def _encode_chunks(store: CorpusStore, encoder, emb_dir: Path, chunk_size: int) -> list[Path]:
    """Encode the corpus into fp16 chunk files, skipping the ones a previous run finished."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    emb_dir.mkdir(parents=True, exist_ok=True)
    n = len(store)
    paths = [emb_dir / f"chunk_{i:05d}.npy" for i in range((n + chunk_size - 1) // chunk_size)]
    todo = [i for i, p in enumerate(paths) if not _chunk_ok(p, min(chunk_size, n - i * chunk_size), encoder.dim)]
    if len(todo) < len(paths):
        logger.info("resuming: %d of %d embedding chunks already done", len(paths) - len(todo), len(paths))
    bar = tqdm(total=sum(min(chunk_size, n - i * chunk_size) for i in todo), desc="encoding", unit="psg")
    for i in todo:
        start, stop = i * chunk_size, min(n, (i + 1) * chunk_size)
        emb = np.empty((stop - start, encoder.dim), dtype=np.float16)
        step = max(encoder.batch_size * 16, 1)  # a slice of the chunk at a time: keeps the bar moving
        for s in range(start, stop, step):
            texts = [d["contents"] for d in store.get(list(range(s, min(stop, s + step))))]
            emb[s - start : s - start + len(texts)] = encoder.encode_passages(texts)
            bar.update(len(texts))
        tmp = paths[i].with_name(paths[i].stem + ".tmp.npy")
        np.save(tmp, emb)
        os.replace(tmp, paths[i])  # a chunk file exists only when complete
    bar.close()
    return paths


def _chunk_ok(path: Path, rows: int, dim: int) -> bool:
    if not path.exists():
        return False
    try:
        return np.load(path, mmap_mode="r").shape == (rows, dim)
    except (ValueError, OSError):
        return False


def _build_dense(chunks: list[Path], dim: int, index_type: str, out_dir: Path, n: int, params: dict) -> dict:
    index = DenseIndex.create(index_type, dim, n=n, **params)
    if index.needs_training:
        index.train(_train_sample(chunks, index.train_size()))
    for path in tqdm(chunks, desc="indexing", unit="chunk"):
        index.add(np.load(path).astype(np.float32))
    if int(index.params["rerank_factor"]) > 1:
        index.write_rerank_vectors(str(out_dir), (np.load(p, mmap_mode="r") for p in chunks))
    index.save(str(out_dir))
    return {"index_type": index_type, "params": index.params, "dim": dim}


def _train_sample(chunks: list[Path], size: int, seed: int = 0) -> np.ndarray:
    """An evenly spread random sample of up to `size` vectors across all chunks."""
    mats = [np.load(p, mmap_mode="r") for p in chunks]
    total = sum(len(m) for m in mats)
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.choice(total, size=min(size, total), replace=False))
    bounds = np.cumsum([0] + [len(m) for m in mats])
    parts = []
    for j, m in enumerate(mats):
        sel = pick[(pick >= bounds[j]) & (pick < bounds[j + 1])] - bounds[j]
        if len(sel):
            parts.append(np.asarray(m[sel], dtype=np.float32))
    return np.concatenate(parts)


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)
