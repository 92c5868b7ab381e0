"""Retrieval server throughput and latency: batched mode vs the Search-R1-like baseline, same index, same run.

Builds (once, cached) a synthetic corpus and a flat MiniLM index, then starts two servers on it as subprocesses with
the same flags — "searchr1", the Search-R1-like baseline (`python -m rsearch_verl.testing.searchr1_server`: requests
in the thread pool, one encode + search per request) and "batched", the product (`python -m retrieval_server serve`:
adaptive micro-batching) — and drives each with a closed-loop load generator running in its OWN process: every
simulated client holds its own keep-alive connection and sends one query per request, back to back, for a fixed
duration per concurrency level. Prints a table (mode, concurrency, QPS, p50, p99, mean batch) and, last, the
headline: QPS(batched) / QPS(searchr1) at the highest concurrency, and batched p99 / p50 there.

    .venv/bin/python benchmarks/retrieval_throughput.py            # 5k docs, 1/16/64 clients, 8 s each (~75 s)
    .venv/bin/python benchmarks/retrieval_throughput.py --n-docs 20000 --duration 10   # the issue's setting

Targets (issue "Foundation and the retrieval server"): >= 5x QPS at concurrency 64, p99 <= 2x p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
logger = logging.getLogger("retrieval_throughput")


# ----------------------------------------------------------------------------------------------------------------
# Load generator (runs in its own process: `--loadgen URL`)
# ----------------------------------------------------------------------------------------------------------------


def _request_bytes(host: str, port: int, body: bytes) -> bytes:
    head = (
        f"POST /retrieve HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _client(host: str, port: int, requests: list[bytes], offset: int, stop_at: float, out: list) -> None:
    """One simulated client: its own connection, one request in flight, raw HTTP/1.1 (a featherweight client)."""
    reader, writer = await asyncio.open_connection(host, port)
    i = offset
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            writer.write(requests[i % len(requests)])
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            t1 = time.perf_counter()
            out.append((t1, t1 - t0, head[9:12] == b"200"))
            i += 1
    finally:
        writer.close()


async def _load(url: str, concurrency: int, duration: float, warmup: float, queries: list[str], topk: int) -> dict:
    host, port_s = url.removeprefix("http://").rsplit(":", 1)
    port = int(port_s)
    bodies = [json.dumps({"queries": [q], "topk": topk, "return_scores": True}).encode() for q in queries]
    requests = [_request_bytes(host, port, b) for b in bodies]
    start = time.perf_counter()
    measure_from = start + warmup
    stop_at = measure_from + duration
    out: list = []
    step = max(1, len(requests) // concurrency)
    await asyncio.gather(*(_client(host, port, requests, c * step, stop_at, out) for c in range(concurrency)))
    window = [(t, lat, ok) for t, lat, ok in out if measure_from <= t <= stop_at]
    lats = sorted(lat for _, lat, _ in window)
    if not lats:
        return {"qps": 0.0, "p50_ms": float("nan"), "p99_ms": float("nan"), "n": 0, "errors": 0}
    return {
        "qps": len(window) / duration,
        "p50_ms": 1000 * lats[len(lats) // 2],
        "p99_ms": 1000 * lats[min(len(lats) - 1, int(0.99 * len(lats)))],
        "n": len(window),
        "errors": sum(not ok for _, _, ok in window),
    }


def loadgen_main(args: argparse.Namespace) -> None:
    queries = json.loads(Path(args.queries_file).read_text())
    result = asyncio.run(_load(args.loadgen, args.concurrency, args.duration, args.warmup, queries, args.topk))
    print(json.dumps(result))  # noqa: T201  (read by the parent process)


# ----------------------------------------------------------------------------------------------------------------
# Orchestration
# ----------------------------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def prepare_index(work: Path, n_docs: int, encoder: str) -> tuple[Path, list[str]]:
    """Synthetic corpus + flat index, cached in `work` (rebuilt only when manifest.json is missing)."""
    from retrieval_server.corpus import make_synthetic_corpus

    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.jsonl"
    queries_path = work / "queries.json"
    if not queries_path.exists():
        pairs = make_synthetic_corpus(str(corpus), n_docs, seed=0)
        queries_path.write_text(json.dumps([q for q, _ in pairs]))
    index = work / f"{encoder}_flat"
    if not (index / "manifest.json").exists():
        logger.info("building %s flat index over %d docs in %s", encoder, n_docs, index)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "retrieval_server", "build", "--corpus", str(corpus), "--encoder", encoder]
        subprocess.run([*cmd, "--index-type", "flat", "--out", str(index)], check=True, cwd=REPO, env=_env())
        logger.info("index built in %.0f s", time.perf_counter() - t0)
    return index, json.loads(queries_path.read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> dict | None:
    import httpx

    try:
        return httpx.get(url, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None


SERVERS = {"batched": ["retrieval_server", "serve"], "searchr1": ["rsearch_verl.testing.searchr1_server"]}


def start_server(index: Path, mode: str, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", *SERVERS[mode], "--index", str(index), "--port", str(port)]
    with log.open("w") as fh:
        proc = subprocess.Popen([*cmd, *extra], cwd=REPO, env=_env(), stdout=fh, stderr=fh)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
        if _get_json(f"{url}/health"):
            return proc, url
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server not healthy in 300 s; see {log}")


def run_level(url: str, concurrency: int, args: argparse.Namespace, queries_file: Path) -> dict:
    cmd = [sys.executable, __file__, "--loadgen", url, "--concurrency", str(concurrency)]
    cmd += ["--duration", str(args.duration), "--warmup", str(args.warmup), "--queries-file", str(queries_file)]
    cmd += ["--topk", str(args.topk)]
    before = (_get_json(f"{url}/health") or {}).get("batching")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=_env())
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    after = (_get_json(f"{url}/health") or {}).get("batching")
    if before and after and after["batches"] > before["batches"]:
        result["mean_batch"] = (after["queries"] - before["queries"]) / (after["batches"] - before["batches"])
    return result


def bench(args: argparse.Namespace) -> list[dict]:
    work = Path(args.work_dir) / f"n{args.n_docs}"
    index, queries = prepare_index(work, args.n_docs, args.encoder)
    queries_file = work / "queries.json"
    extra = ["--batch-max", str(args.batch_max), "--batch-wait-ms", str(args.batch_wait_ms)]
    if args.threads:
        extra += ["--threads", str(args.threads)]
    if args.workers:
        extra += ["--workers", str(args.workers)]
    rows = []
    for mode in args.modes.split(","):
        proc, url = start_server(index, mode, extra, work / f"server_{mode}.log")
        try:
            for c in args.concurrency_levels:
                res = run_level(url, c, args, queries_file)
                rows.append({"mode": mode, "concurrency": c, **res})
                logger.info("%s c=%d: %s", mode, c, res)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    logger.info("%d queries available, %d docs", len(queries), args.n_docs)
    return rows


def report(rows: list[dict]) -> None:
    print(f"{'mode':<10} {'conc':>5} {'QPS':>8} {'p50 ms':>9} {'p99 ms':>9} {'batch':>6} {'errors':>6}")  # noqa: T201
    for r in rows:
        batch = f"{r['mean_batch']:.1f}" if "mean_batch" in r else "-"
        print(  # noqa: T201
            f"{r['mode']:<10} {r['concurrency']:>5} {r['qps']:>8.1f} {r['p50_ms']:>9.1f} {r['p99_ms']:>9.1f} "
            f"{batch:>6} {r['errors']:>6}"
        )
    top = max(r["concurrency"] for r in rows)
    at_top = {r["mode"]: r for r in rows if r["concurrency"] == top}
    if {"batched", "searchr1"} <= set(at_top):
        b, s = at_top["batched"], at_top["searchr1"]
        ratio = b["qps"] / s["qps"] if s["qps"] else float("inf")
        print(  # noqa: T201
            f"headline: batched/searchr1 QPS at concurrency {top} = {ratio:.2f}x "
            f"({b['qps']:.0f} vs {s['qps']:.0f} QPS); batched p99/p50 = {b['p99_ms'] / b['p50_ms']:.2f} "
            f"(targets >= 5x, <= 2)"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-docs", type=int, default=5000)
    p.add_argument("--encoder", default="minilm")
    p.add_argument("--work-dir", default=str(REPO / "outputs" / "bench_retrieval"))
    p.add_argument("--modes", default="searchr1,batched")
    p.add_argument("--concurrency-levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per level")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each level")
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--batch-max", type=int, default=64)
    p.add_argument("--batch-wait-ms", type=float, default=0.0)
    p.add_argument("--threads", type=int, default=0, help="server torch threads (0 = default)")
    p.add_argument("--workers", type=int, default=0, help="batched mode: concurrent search batches (0 = auto)")
    p.add_argument("--json-out", default=None, help="also write the rows as JSON here")
    # internal: the load generator process
    p.add_argument("--loadgen", default=None, help=argparse.SUPPRESS)
    p.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--queries-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.loadgen:
        loadgen_main(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rows = bench(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    report(rows)


if __name__ == "__main__":
    main()
