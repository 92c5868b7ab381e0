"""FAISS inner-product indexes over L2-normalised vectors, with optional exact re-ranking from disk.

Index types (`params` in brackets, all optional):

    flat      exact search (IndexFlatIP); 4*d bytes per vector
    hnsw      HNSW graph over full vectors [hnsw_m=32, ef_construction=200, ef_search=128]
    hnsw_sq8  HNSW graph over 8-bit scalar-quantised vectors [same as hnsw]
    ivfpq     inverted lists + product quantisation [nlist, pq_m=d/8 (=96 for 768-d), nbits=8, nprobe=64]
    ivfpq_rerank  ivfpq whose candidates are re-scored exactly [same as ivfpq but nprobe=256, rerank_factor=32]
    sq8       8-bit scalar quantisation, exhaustive scan; d bytes per vector

`rerank_factor > 1` (any type; the default of `ivfpq_rerank`) keeps the vectors as fp16 in a memory-mapped
`vectors.f16.npy` on disk; the compact index returns `rerank_factor * k` candidates and they are re-scored
exactly. That is how a 21M x 768 Wikipedia index stays within a few GB of RAM (IVF-PQ codes, ~2.2 GB) and still
reaches recall@3 >= 0.95 (see benchmarks/retrieval_index.py and docs/retriever.md).

GPU: with `device="cuda"` and a faiss build with GPUs, the index is sharded over all GPUs
(`faiss.index_cpu_to_all_gpus`); faiss-cpu builds fall back to the CPU index with a warning.

Usage:
    idx = DenseIndex.create("ivfpq", dim=768, nlist=4096, rerank_factor=4)
    idx.train(sample); idx.add(vectors); idx.save("out/")   # rerank vectors: idx.write_rerank_vectors(...)
    idx = DenseIndex.load("out/"); scores, rows = idx.search(queries, k=3)
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import faiss
import numpy as np

logger = logging.getLogger(__name__)

INDEX_TYPES = ("flat", "hnsw", "hnsw_sq8", "ivfpq", "ivfpq_rerank", "sq8")
IVF_TYPES = ("ivfpq", "ivfpq_rerank")
# ivfpq_rerank defaults: PQ codes alone miss half the true top-3 on our synthetic benchmark; re-scoring 32*k
# candidates from the fp16 vectors fixes the code error, and a wider probe fixes the lists the codes never saw.
RERANK_DEFAULT = 32
RERANK_NPROBE = 256
COARSE_NITER = 10  # k-means iterations for the IVF centroids (FAISS default 25: 2.5x the training time, same recall)
INDEX_FILE = "index.faiss"
RERANK_FILE = "vectors.f16.npy"
PARAMS_FILE = "index_params.json"


def default_params(index_type: str, dim: int, n: int | None = None) -> dict:
    """Parameters used when the caller gives none; `nlist` follows the usual ~4*sqrt(n) rule."""
    if index_type not in INDEX_TYPES:
        raise ValueError(f"index type must be one of {INDEX_TYPES}, got {index_type!r}")
    p: dict = {"rerank_factor": 1}
    if index_type in ("hnsw", "hnsw_sq8"):
        p.update(hnsw_m=32, ef_construction=200, ef_search=128)
    if index_type in IVF_TYPES:
        nlist = 4096 if n is None else max(1, min(65536, int(4 * math.sqrt(n))))
        p.update(nlist=nlist, pq_m=_pq_m(dim), nbits=8, nprobe=64)
    if index_type == "ivfpq_rerank":
        p.update(rerank_factor=RERANK_DEFAULT, nprobe=RERANK_NPROBE)
    return p


def _pq_m(dim: int) -> int:
    """Largest sub-quantiser count <= dim/8 that divides dim (8-dim sub-vectors keep PQ error low)."""
    m = max(1, dim // 8)
    while dim % m:
        m -= 1
    return m


def _factory(index_type: str, dim: int, p: dict) -> faiss.Index:
    ip = faiss.METRIC_INNER_PRODUCT
    if index_type == "flat":
        return faiss.IndexFlatIP(dim)
    if index_type == "sq8":
        return faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_8bit, ip)
    if index_type in ("hnsw", "hnsw_sq8"):
        if index_type == "hnsw":
            index = faiss.IndexHNSWFlat(dim, int(p["hnsw_m"]), ip)
        else:
            index = faiss.IndexHNSWSQ(dim, faiss.ScalarQuantizer.QT_8bit, int(p["hnsw_m"]), ip)
        index.hnsw.efConstruction = int(p["ef_construction"])
        return index
    if dim % int(p["pq_m"]):
        raise ValueError(f"pq_m={p['pq_m']} must divide the dimension {dim}")
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFPQ(quantizer, dim, int(p["nlist"]), int(p["pq_m"]), int(p["nbits"]), ip)
    index.cp.niter = COARSE_NITER
    return index


class DenseIndex:
    """A FAISS index plus its search-time parameters and the optional fp16 re-ranking vectors."""

    def __init__(self, index: faiss.Index, index_type: str, params: dict, rerank: np.ndarray | None = None) -> None:
        self.index = index
        self.index_type = index_type
        self.params = params
        self.rerank = rerank
        self.dim = int(index.d)
        self._apply_search_params(index)

    @classmethod
    def create(cls, index_type: str, dim: int, n: int | None = None, **params) -> DenseIndex:
        p = default_params(index_type, dim, n)
        unknown = set(params) - set(p)
        if unknown:
            raise ValueError(f"unknown parameters for {index_type}: {sorted(unknown)} (known: {sorted(p)})")
        p.update({k: v for k, v in params.items() if v is not None})
        if int(p["rerank_factor"]) < 1:
            raise ValueError(f"rerank_factor must be >= 1, got {p['rerank_factor']}")
        return cls(_factory(index_type, dim, p), index_type, p)

    @property
    def needs_training(self) -> bool:
        return not self.index.is_trained

    def train_size(self) -> int:
        """How many sample vectors training wants (IVF: ~40 per list, enough for the PQ codebooks too)."""
        if not self.needs_training:
            return 0
        return max(40 * int(self.params.get("nlist", 1)), 256 * 40) if self.index_type in IVF_TYPES else 65536

    def train(self, sample: np.ndarray) -> None:
        if self.needs_training:
            need = max(int(self.params.get("nlist", 1)), 2 ** int(self.params.get("nbits", 0)))
            if len(sample) < need:
                raise ValueError(f"{self.index_type} needs >= {need} training vectors, got {len(sample)}")
            self._warn_small_sample(len(sample))
            self.index.train(np.ascontiguousarray(sample, dtype=np.float32))

    def _warn_small_sample(self, n: int) -> None:
        """faiss prints "please provide at least ... training points" once per k-means it runs when the sample is
        under its rule of thumb: the coarse quantizer and each of the pq_m sub-quantizers, 97 lines for a 768-d
        IVF-PQ on a small corpus. Say it once here and let faiss train quietly (the threshold only gates that
        message; the clustering is the same)."""
        ivf = self.index
        if not isinstance(ivf, faiss.IndexIVFPQ):
            return
        quantizers = [(ivf.cp, ivf.nlist), (ivf.pq.cp, 1 << ivf.pq.nbits)]
        wanted = max(k * cp.min_points_per_centroid for cp, k in quantizers)
        if n < wanted:
            logger.warning(
                "training %s on %d vectors, fewer than the %d faiss recommends (tiny corpus: recall may suffer)",
                self.index_type,
                n,
                wanted,
            )
            for cp, _ in quantizers:
                cp.min_points_per_centroid = 1

    def add(self, vectors: np.ndarray) -> None:
        self.index.add(np.ascontiguousarray(vectors, dtype=np.float32))

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def set_search_params(self, **params) -> None:
        """Change search-time parameters (nprobe, ef_search, rerank_factor) of a built index in place."""
        allowed = {"nprobe", "ef_search", "rerank_factor"} & set(self.params)
        if set(params) - allowed:
            raise ValueError(f"search-time parameters of {self.index_type}: {sorted(allowed)}, got {sorted(params)}")
        if int(params.get("rerank_factor", 1)) > 1 and self.rerank is None:
            raise ValueError("rerank_factor > 1 needs the fp16 re-ranking vectors (build with --rerank-factor)")
        self.params.update(params)
        self._apply_search_params(self.index)

    def _apply_search_params(self, index: faiss.Index) -> None:
        if self.index_type in ("hnsw", "hnsw_sq8"):
            faiss.downcast_index(index).hnsw.efSearch = int(self.params["ef_search"])
        elif self.index_type in IVF_TYPES:
            faiss.extract_index_ivf(index).nprobe = int(self.params["nprobe"])

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, rows) per query, best first; k is clipped to the index size."""
        k = max(1, min(int(k), self.ntotal))
        q = np.ascontiguousarray(queries, dtype=np.float32)
        rf = int(self.params.get("rerank_factor", 1))
        if self.rerank is None or rf <= 1:
            return self.index.search(q, k)
        kc = min(self.ntotal, k * rf)
        _, cand = self.index.search(q, kc)
        return rerank_exact(q, cand, self.rerank, k)

    def write_rerank_vectors(self, out_dir: str, chunks) -> None:
        """Write the fp16 re-ranking matrix from an iterable of [m, d] arrays (row order = index order)."""
        path = Path(out_dir) / RERANK_FILE
        tmp = path.with_name(path.name + ".tmp.npy")
        mat = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(self.ntotal, self.dim))
        pos = 0
        for c in chunks:
            mat[pos : pos + len(c)] = c
            pos += len(c)
        if pos != self.ntotal:
            raise ValueError(f"re-ranking vectors: got {pos} rows, the index has {self.ntotal}")
        mat.flush()
        del mat
        os.replace(tmp, path)

    def save(self, out_dir: str) -> None:
        out = Path(out_dir)
        tmp = out / (INDEX_FILE + ".tmp")
        faiss.write_index(self.index, str(tmp))
        os.replace(tmp, out / INDEX_FILE)
        (out / PARAMS_FILE).write_text(json.dumps({"index_type": self.index_type, "params": self.params}))

    @classmethod
    def load(cls, out_dir: str, device: str = "cpu") -> DenseIndex:
        out = Path(out_dir)
        meta = json.loads((out / PARAMS_FILE).read_text())
        # IVF inverted lists memory-mapped on CPU: replicas of one host share them through the page cache. FAISS
        # (1.15) maps nothing else: flat, sq8 and HNSW codes are read into each process (measured, docs/retriever.md)
        flags = faiss.IO_FLAG_MMAP if meta["index_type"] in IVF_TYPES and not device.startswith("cuda") else 0
        index = faiss.read_index(str(out / INDEX_FILE), flags)
        rerank = None
        if int(meta["params"].get("rerank_factor", 1)) > 1:
            rerank = np.load(out / RERANK_FILE, mmap_mode="r")
        loaded = cls(index, meta["index_type"], meta["params"], rerank)
        if device.startswith("cuda"):
            loaded.index = _to_gpus(index, loaded.index_type, loaded.params)
        return loaded


def rerank_exact(q: np.ndarray, cand: np.ndarray, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Re-score candidate rows exactly against `vectors` (may be a disk memmap) and keep the top k."""
    nq = len(q)
    valid = cand >= 0  # FAISS pads with -1 when a probe finds fewer than asked
    uniq = np.unique(cand[valid])  # sorted: sequential reads on the memmap, each row read once
    vec = np.asarray(vectors[uniq], dtype=np.float32)
    pos = np.searchsorted(uniq, np.where(valid, cand, uniq[0] if len(uniq) else 0))
    scores = np.einsum("qd,qcd->qc", q, vec[pos]) if len(uniq) else np.zeros(cand.shape, np.float32)
    scores = np.where(valid, scores, -np.inf).astype(np.float32)
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    rows = np.take_along_axis(cand, top, axis=1)
    out_scores = np.take_along_axis(scores, top, axis=1)
    out_scores[rows < 0] = -np.inf
    return out_scores.reshape(nq, -1), rows.reshape(nq, -1)


def _to_gpus(index: faiss.Index, index_type: str, params: dict) -> faiss.Index:
    """Shard `index` over all GPUs; HNSW has no GPU version and stays on the CPU."""
    if not hasattr(faiss, "get_num_gpus") or faiss.get_num_gpus() == 0:
        logger.warning("device=cuda but this faiss build has no GPUs: searching on the CPU")
        return index
    if index_type.startswith("hnsw"):
        logger.warning("FAISS has no GPU HNSW: %s index searched on the CPU", index_type)
        return index
    co = faiss.GpuMultipleClonerOptions()
    co.shard = True  # split the vectors over the GPUs instead of a full copy on each
    co.useFloat16 = True
    gpu_index = faiss.index_cpu_to_all_gpus(index, co=co)
    if index_type in IVF_TYPES:  # the CPU-side nprobe does not carry over to the GPU clones
        faiss.GpuParameterSpace().set_index_parameter(gpu_index, "nprobe", int(params["nprobe"]))
    return gpu_index
