"""Resident memory per Ray Serve replica of the retrieval server, 1 vs 2 replicas on one host, per index type.

Builds (once, cached in --work-dir) a synthetic corpus and three indexes over it: MiniLM `flat`, MiniLM
`ivfpq_rerank` (the embeddings are encoded once and reused) and `bm25`. For each index and each replica count it
starts `python -m retrieval_server serve --replicas N --host 127.0.0.1` on a local Ray of its own (private
RAY_TMPDIR, so it never joins another Ray on the machine), waits until N distinct replica processes answer /health,
drives a warm-up of queries through the proxy (so the pages a search touches are resident), and reads each replica's
`psutil.Process.memory_full_info()`: USS (pages only this process holds), PSS (shared pages split between the
processes that map them) and RSS. What replicas of one host can share is memory-mapped: the corpus text, the rerank
vectors (np.load mmap), the BM25 arrays (bm25s mmap) and IVF lists (FAISS IO_FLAG_MMAP); flat codes are read into
each replica's own memory. So with sharing, the second replica costs its USS, not its RSS.

Prints a table (index, replicas, replica pid, USS / PSS / RSS MiB, the RSS and PSS of the index's own files mapped
into the replica -- "mmap", halved in PSS when two replicas share them --, total PSS of the replicas, the index's size
on disk) and last the line `ivfpq_rerank: 2-replica total PSS / 1-replica PSS = X.XX` (2.00 = nothing shared).

    .venv/bin/python benchmarks/retrieval_replica_memory.py                  # 20k docs, 20 s warm-up per server
    .venv/bin/python benchmarks/retrieval_replica_memory.py --docs 3000 --warmup-s 5   # a smoke run (~8 min)

The build is dominated by encoding the corpus with MiniLM once (18 passages/s measured on 2 busy cores: ~18 min for
20k docs there; cached afterwards); each of the 6 servers then takes ~80 s (a local Ray, Serve, the index load, the
warm-up) on 2 busy cores.

PSS also splits shared-library pages (torch, faiss) with every other Python process on the machine that maps them,
so run it on a quiet machine; USS does not depend on that.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from retrieval_scaleout import shielded, wait_replicas  # noqa: E402
from retrieval_throughput import _env, _free_port, _load  # noqa: E402

logger = logging.getLogger("retrieval_replica_memory")
INDEXES = ("flat", "ivfpq_rerank", "bm25")
REPLICA_TITLE = "ServeReplica:retriever:RetrieverReplica"  # Ray's process title of a replica of replicas.py's app
MIB = 1 << 20


def build_indexes(work: Path, n_docs: int, kinds: list[str]) -> tuple[dict[str, Path], list[str]]:
    """Synthetic corpus + the requested indexes, cached in `work` (an index is rebuilt only without manifest.json)."""
    from retrieval_server.build import EMB_DIR
    from retrieval_server.corpus import make_synthetic_corpus

    work.mkdir(parents=True, exist_ok=True)
    corpus, queries_path = work / "corpus.jsonl", work / "queries.json"
    if not queries_path.exists():
        pairs = make_synthetic_corpus(str(corpus), n_docs, seed=0)
        queries_path.write_text(json.dumps([q for q, _ in pairs]))
    out = {}
    for kind in kinds:
        index = work / kind
        out[kind] = index
        if (index / "manifest.json").exists():
            continue
        encoder = "bm25" if kind == "bm25" else "minilm"
        done_emb = [work / k / EMB_DIR for k in kinds if k != kind and (work / k / EMB_DIR).is_dir()]
        if encoder == "minilm" and done_emb and not (index / EMB_DIR).exists():
            shutil.copytree(done_emb[0], index / EMB_DIR, copy_function=os.link)  # same corpus: reuse the encoding
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "retrieval_server", "build", "--corpus", str(corpus), "--encoder", encoder]
        cmd += ["--index-type", "flat" if kind == "bm25" else kind, "--out", str(index)]
        subprocess.run(cmd, check=True, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL)
        logger.info("built %s over %d docs in %.0f s", kind, n_docs, time.perf_counter() - t0)
    return out, json.loads(queries_path.read_text())


def dir_mib(path: Path) -> float:
    """What the server reads: the index directory without the build's embedding chunks."""
    from retrieval_server.build import EMB_DIR

    files = [f for f in path.rglob("*") if f.is_file() and EMB_DIR not in f.relative_to(path).parts]
    return sum(f.stat().st_size for f in files) / MIB


def kill_leftovers(tmp: Path) -> None:
    """Kill, by pid, any process of the local Rays started under `tmp` that outlived its server (a killed driver
    leaves its raylet and GCS behind)."""
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(str(tmp) in part for part in p.info["cmdline"] or []):
                logger.warning("killing leftover %d: %s", p.pid, " ".join(p.info["cmdline"])[:120])
                p.kill()


def replica_pids(url: str, n: int, proc: subprocess.Popen, log: Path) -> set[int]:
    """Poll /health until `n` distinct processes answered (the proxy balances the probes over the replicas)."""
    return wait_replicas([url], n, proc, log)


def titled_replicas() -> set[int]:
    """Processes whose title names a replica of the retriever app (a cross-check of the /health pids)."""
    found = set()
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(REPLICA_TITLE in part for part in p.info["cmdline"] or []):
                found.add(p.pid)
    return found


def measure(index: Path, replicas: int, queries: list[str], args: argparse.Namespace, tmp: Path) -> list[dict]:
    port = _free_port()
    env = {**_env(), "RAY_TMPDIR": str(tmp / f"r{replicas}"), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)  # a local Ray of its own
    (tmp / f"r{replicas}").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "retrieval_server", "serve", "--index", str(index), "--replicas", str(replicas)]
    cmd += ["--replica-cpus", "1", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    log = index.parent / f"serve_{index.name}_{replicas}.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        pids = replica_pids(url, replicas, proc, log)
        load = asyncio.run(_load(url, args.concurrency, args.warmup_s, 0.0, queries, args.topk))
        titled = titled_replicas()
        if not pids <= titled:
            logger.warning("replica pids %s not among the titled replica processes %s", sorted(pids), sorted(titled))
        rows = []
        for pid in sorted(pids):
            proc_ = psutil.Process(pid)
            mem = proc_.memory_full_info()
            # the part of it that is the index's own files mapped into memory (corpus, rerank vectors, BM25, IVF)
            mapped = [m for m in proc_.memory_maps(grouped=True) if m.path.startswith(f"{index.resolve()}/")]
            rows.append(
                {
                    "pid": pid,
                    "uss": mem.uss / MIB,
                    "pss": mem.pss / MIB,
                    "rss": mem.rss / MIB,
                    "map_rss": sum(m.rss for m in mapped) / MIB,
                    "map_pss": sum(m.pss for m in mapped) / MIB,
                }
            )
        logger.info("%s x%d: warm-up %.0f QPS, %d errors; %s", index.name, replicas, load["qps"], load["errors"], rows)
        return rows
    finally:
        with shielded():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # the server deletes its app and stops the Ray it started
                try:
                    proc.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def report(results: dict[tuple[str, int], list[dict]], sizes: dict[str, float], headline: str) -> None:
    print(  # noqa: T201
        f"{'index':<13} {'replicas':>8} {'pid':>8} {'USS MiB':>8} {'PSS MiB':>8} {'RSS MiB':>8} "
        f"{'mmap RSS':>8} {'mmap PSS':>8} {'total PSS':>9} {'on disk':>8}"
    )
    for (kind, n), rows in results.items():
        total = sum(r["pss"] for r in rows)
        for j, r in enumerate(rows):
            tail = f"{total:>9.0f} {sizes[kind]:>8.0f}" if j == 0 else f"{'':>9} {'':>8}"
            print(  # noqa: T201
                f"{kind:<13} {n:>8} {r['pid']:>8} {r['uss']:>8.0f} {r['pss']:>8.0f} {r['rss']:>8.0f} "
                f"{r['map_rss']:>8.1f} {r['map_pss']:>8.1f} {tail}"
            )
    for kind in sizes:
        one, two = results.get((kind, 1)), results.get((kind, 2))
        if one and two:
            ratio = sum(r["pss"] for r in two) / sum(r["pss"] for r in one)
            line = f"{kind}: 2-replica total PSS / 1-replica PSS = {ratio:.2f}"
            if kind != headline:
                print(f"  {line}")  # noqa: T201
    one, two = results.get((headline, 1)), results.get((headline, 2))
    ratio = sum(r["pss"] for r in two) / sum(r["pss"] for r in one) if one and two else float("nan")
    print(f"{headline}: 2-replica total PSS / 1-replica PSS = {ratio:.2f}")  # noqa: T201


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=20000, help="synthetic corpus size")
    p.add_argument("--indexes", type=lambda s: s.split(","), default=list(INDEXES), help=",".join(INDEXES))
    p.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--warmup-s", type=float, default=20.0, help="seconds of queries before measuring")
    p.add_argument("--concurrency", type=int, default=16, help="warm-up clients")
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--work-dir", default=str(REPO / "outputs" / "bench_replica_memory"), help="index cache")
    p.add_argument("--json-out", default=None, help="also write the rows as JSON here")
    args = p.parse_args()
    if set(args.indexes) - set(INDEXES):
        p.error(f"unknown indexes {sorted(set(args.indexes) - set(INDEXES))}; choose from {INDEXES}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through the clean-up, as Ctrl-C does
    indexes, queries = build_indexes(Path(args.work_dir) / f"n{args.docs}", args.docs, args.indexes)
    results: dict[tuple[str, int], list[dict]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="rsvmem", dir="/tmp"))  # short: Ray's unix socket paths have a length limit
    try:
        for kind, index in indexes.items():
            for n in args.replicas:
                results[(kind, n)] = measure(index, n, queries, args, tmp)
    finally:
        with shielded():
            kill_leftovers(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json_out:
        rows = [{"index": k, "replicas": n, **r} for (k, n), rs in results.items() for r in rs]
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    headline = "ivfpq_rerank" if "ivfpq_rerank" in indexes else args.indexes[0]
    report(results, {k: dir_mib(v) for k, v in indexes.items()}, headline)


if __name__ == "__main__":
    main()
