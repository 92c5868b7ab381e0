"""Index memory vs recall vs speed: flat, SQ8, HNSW, HNSW-SQ8, IVF-PQ, and IVF-PQ + exact re-rank, on synthetic data.

A synthetic corpus of clustered unit vectors (default 50k x 768, with a decaying spectrum like real sentence
embeddings) and queries made by perturbing planted passages. Every configuration is built with the server's own
`retrieval_server.index.DenseIndex` (so this measures what `serve` runs), saved and loaded back from disk (so the
re-ranking vectors really are a memory-mapped fp16 file). For each it prints:

* bytes per vector held in RAM (the serialised FAISS index, fixed parts such as IVF centroids excluded) and the
  same extrapolated to wiki-18 (21,015,324 x 768) in GB, plus the disk-only part (memory-mapped re-rank vectors);
* recall@3 against the exact flat top-3, and the hit rate of the planted passage at rank 1;
* QPS searching the queries in batches of 64 (as the server's micro-batcher sends them).

Last line: the best configuration whose extrapolated RAM is <= 8 GB, with its recall@3 (target >= 0.95).

    .venv/bin/python benchmarks/retrieval_index.py                # 50k x 768, ~2-3 min on 2 busy cores
    .venv/bin/python benchmarks/retrieval_index.py --n 100000       # ~4 min idle, ~7 min on 2 busy cores
    .venv/bin/python benchmarks/retrieval_index.py --n 20000 --nq 200 --configs flat,ivfpq,ivfpq_rerank
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Before faiss loads OpenMP: waiting threads sleep instead of spinning, which on a busy 2-core machine otherwise
# makes every k-means iteration's barrier cost a scheduler time slice (IVF training ran several times slower).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import faiss  # noqa: E402
import numpy as np  # noqa: E402

from retrieval_server.index import DenseIndex, default_params  # noqa: E402

logger = logging.getLogger("retrieval_index")
WIKI_N = 21_015_324
RAM_BUDGET_GB = 8.0


SHOWN_PARAMS = ("hnsw_m", "ef_search", "nlist", "pq_m", "nprobe")
IVF_SEARCHES = (
    {"nprobe": 64, "rerank_factor": 1},
    {"nprobe": 64, "rerank_factor": 32},
    {"nprobe": 256, "rerank_factor": 1},
    {"nprobe": 256, "rerank_factor": 32},
)


@dataclass
class Config:
    """One index build; each of `searches` (search-time parameters) is measured on that same build."""

    name: str
    index_type: str
    params: dict
    searches: tuple[dict, ...] = ({},)


def configs(dim: int) -> dict[str, Config]:
    """The compared builds; IVF parameters follow the server's defaults (nlist ~ 4 sqrt(n), pq_m = d / 8)."""
    hnsw = {"hnsw_m": 32, "ef_construction": 64, "ef_search": 128}
    return {
        "flat": Config("flat", "flat", {}),
        "sq8": Config("sq8", "sq8", {}),
        "hnsw": Config("hnsw", "hnsw", hnsw),
        "hnsw_sq8": Config("hnsw_sq8", "hnsw_sq8", hnsw),
        # One IVF-PQ build searched several ways: the codes alone (= index type `ivfpq`, nprobe 64), re-ranked, and
        # the `ivfpq_rerank` type's defaults (nprobe 256, rerank_factor 32) last; then the same with half the codes.
        "ivfpq": Config("ivfpq", "ivfpq_rerank", {}, searches=IVF_SEARCHES),
        "ivfpq48": Config("ivfpq48", "ivfpq_rerank", {"pq_m": dim // 16}, searches=IVF_SEARCHES[-1:]),
        # the `ivfpq_rerank` index type as `serve` runs it (nprobe 256, rerank_factor 32) on its own build
        "ivfpq_rerank": Config("ivfpq_rerank", "ivfpq_rerank", {}, searches=IVF_SEARCHES[-1:]),
    }


CONFIG_NAMES = tuple(configs(768))


def config_list(value: str) -> list[str]:
    """--configs: comma-separated names, all checked before any work (an unknown one used to fail after the others
    had run, printing no table)."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIG_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown config(s) {', '.join(unknown) or '(none)'}; valid: {', '.join(CONFIG_NAMES)}"
        )
    return names


def make_data(n: int, dim: int, nq: int, clusters: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Corpus [n, dim], queries [nq, dim] (unit rows) and the planted passage of each query."""
    rng = np.random.default_rng(seed)
    spectrum = (1.0 + np.arange(dim, dtype=np.float32)) ** -0.5  # a few strong directions, a long tail
    centers = rng.standard_normal((clusters, dim), dtype=np.float32) * spectrum
    assign = rng.integers(0, clusters, n)
    x = centers[assign] + 0.6 * rng.standard_normal((n, dim), dtype=np.float32) * spectrum
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    planted = rng.choice(n, nq, replace=False)
    q = x[planted] + 0.35 * rng.standard_normal((nq, dim), dtype=np.float32) * spectrum
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    return x, q.astype(np.float32), planted


def _ram_bytes(index: faiss.Index) -> int:
    return int(faiss.serialize_index(index).nbytes)


def _search_all(index: DenseIndex, q: np.ndarray, k: int, batch: int = 64) -> tuple[np.ndarray, float]:
    t0 = time.perf_counter()
    rows = [index.search(q[s : s + batch], k)[1] for s in range(0, len(q), batch)]
    return np.concatenate(rows), len(q) / (time.perf_counter() - t0)


def measure(cfg: Config, x: np.ndarray, q: np.ndarray, truth: np.ndarray, planted: np.ndarray, k: int) -> list[dict]:
    """Build, save, reload and search one configuration (once per re-rank factor); memory, recall and speed."""
    n, dim = x.shape
    t0 = time.perf_counter()
    index = DenseIndex.create(cfg.index_type, dim, n=n, **cfg.params)
    if index.needs_training:
        rng = np.random.default_rng(1)
        index.train(x[rng.choice(n, min(n, index.train_size()), replace=False)])
    empty_bytes = _ram_bytes(index.index)  # trained, no vectors: the fixed part (centroids, codebooks)
    index.add(x)
    with tempfile.TemporaryDirectory() as tmp:
        if int(index.params["rerank_factor"]) > 1:
            index.write_rerank_vectors(tmp, [x.astype(np.float16)])
        index.save(tmp)
        build_s = time.perf_counter() - t0
        loaded = DenseIndex.load(tmp)
        ram_per_vec = (_ram_bytes(loaded.index) - empty_bytes) / n
        out = []
        for search in cfg.searches:
            loaded.set_search_params(**search)
            rows, qps = _search_all(loaded, q, k)
            recall = np.mean([len(set(r) & set(t)) / k for r, t in zip(rows, truth, strict=True)])
            rf = int(loaded.params["rerank_factor"])
            name = cfg.name + (f"+rerank{rf}" if rf > 1 else "")
            shown = {
                k_: v for k_, v in loaded.params.items() if k_ in ("hnsw_m", "ef_search", "nlist", "pq_m", "nprobe")
            }
            out.append(
                {
                    "config": name,
                    "params": shown,
                    "ram_bytes_per_vec": ram_per_vec,
                    "wiki_ram_gb": (empty_bytes + ram_per_vec * WIKI_N) / 1e9,
                    "wiki_disk_gb": (2 * dim if rf > 1 else 0) * WIKI_N / 1e9,
                    "recall_at_k": float(recall),
                    "planted_at_1": float(np.mean(rows[:, 0] == planted)),
                    "qps": qps,
                    "build_s": build_s,
                }
            )
        del loaded  # close the memmap before the directory goes
    return out


def report(results: list[dict], k: int) -> None:
    head = f"{'config':<22} {'B/vec RAM':>9} {'wiki RAM GB':>11} {'+disk GB':>8} {f'recall@{k}':>9} "
    print(head + f"{'planted@1':>9} {'QPS':>8} {'build s':>7}  params")  # noqa: T201
    for r in results:
        print(  # noqa: T201
            f"{r['config']:<22} {r['ram_bytes_per_vec']:>9.1f} {r['wiki_ram_gb']:>11.2f} {r['wiki_disk_gb']:>8.1f} "
            f"{r['recall_at_k']:>9.3f} {r['planted_at_1']:>9.3f} {r['qps']:>8.0f} {r['build_s']:>7.1f}  {r['params']}"
        )
    fits = [r for r in results if r["wiki_ram_gb"] <= RAM_BUDGET_GB]
    if not fits:
        print(f"headline: no configuration fits {RAM_BUDGET_GB:.0f} GB of RAM for 21M x 768")  # noqa: T201
        return
    best = max(fits, key=lambda r: (r["recall_at_k"], r["qps"]))
    print(  # noqa: T201
        f"headline: best <= {RAM_BUDGET_GB:.0f} GB RAM for 21M x 768: {best['config']} at {best['wiki_ram_gb']:.2f} GB "
        f"(+{best['wiki_disk_gb']:.0f} GB memory-mapped on disk), recall@{k} = {best['recall_at_k']:.3f} vs flat, "
        f"{best['qps']:.0f} QPS (target >= 0.95)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=50_000, help="corpus vectors")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--nq", type=int, default=300, help="queries")
    p.add_argument("--clusters", type=int, default=2000)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--configs",
        type=config_list,
        default="flat,sq8,hnsw,ivfpq,ivfpq48",
        help=f"comma-separated, any of: {', '.join(CONFIG_NAMES)} (default: %(default)s)",
    )
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    t0 = time.perf_counter()
    x, q, planted = make_data(args.n, args.dim, args.nq, args.clusters, args.seed)
    exact = faiss.IndexFlatIP(args.dim)
    exact.add(x)
    truth = exact.search(q, args.k)[1]
    logger.info(
        "data %d x %d, %d queries, exact top-%d in %.1f s", args.n, args.dim, args.nq, args.k, time.perf_counter() - t0
    )
    table = configs(args.dim)
    results = []
    for name in args.configs:
        res = measure(table[name], x, q, truth, planted, args.k)
        logger.info("%s: %s", name, res)
        results.extend(res)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    logger.info(
        "total %.0f s; server defaults for n=%d: %s",
        time.perf_counter() - t0,
        args.n,
        default_params("ivfpq", args.dim, args.n),
    )
    report(results, args.k)


if __name__ == "__main__":
    main()
