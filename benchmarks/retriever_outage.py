"""Outage and recovery times of the recipe's own retrieval server under the driver's supervision.

A BM25 index over a small corpus is served by `python -m retrieval_server serve`, started by `RetrieverService` exactly
as a training run starts it, and watched by `RetrieverSupervisor` (rsearch_verl/search/supervisor.py) with the
default `retriever.supervisor` settings. Each trial SIGKILLs the server while the supervisor watches (as during a
step) and measures, from the kill:

* healthy_s  until the restarted server answers GET /health (the supervisor's next poll, at most check_interval_s
             later, then its restart: backoff_s + the server's start-up)
* search_s   until a POST /retrieve on the same URL returns passages again (what a paused rollout waits for)
* down_s     the supervisor's own measure (retriever/down_s in metrics.jsonl)

It then prints the median of each, and a last line with the median time from the kill to a working search.
Measured on the 2-core CPU machine (shared, load ~4), 5 trials: healthy_s 4.60, search_s 6.50, down_s 3.79 (medians).

    .venv/bin/python benchmarks/retriever_outage.py                 # 5 trials, ~1 min on 2 busy cores
    .venv/bin/python benchmarks/retriever_outage.py --trials 10 --backoff-s 0.1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import tempfile
import time

import httpx

from rsearch_verl.config import RetrieverConfig
from rsearch_verl.search.service import RetrieverService, ensure_index
from rsearch_verl.search.supervisor import RetrieverSupervisor

logger = logging.getLogger("retriever_outage")


def _corpus(path: str, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": str(i), "contents": f'"Entity {i}"\nThe emblem of entity {i} is shape {i % 7}.'}))
            f.write("\n")


def _until(predicate, start: float, timeout_s: float = 120.0) -> float:
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError("no recovery in time")
        time.sleep(0.02)
    return time.monotonic() - start


def _answers(url: str, path: str) -> bool:
    try:
        if path == "/health":
            return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
        resp = httpx.post(f"{url}/retrieve", json={"queries": ["emblem of entity 3"], "topk": 1}, timeout=5.0)
        return resp.status_code == 200 and len(resp.json()["result"][0]) == 1
    except httpx.HTTPError:
        return False


def trial(service: RetrieverService, sup: RetrieverSupervisor) -> dict[str, float]:
    with sup.watching():
        start = time.monotonic()
        os.kill(service.proc.pid, signal.SIGKILL)
        healthy = _until(lambda: _answers(service.url, "/health"), start)
        search = _until(lambda: _answers(service.url, "/retrieve"), start)
    metrics = sup.step_metrics()
    sup.take_outages()
    return {"healthy_s": healthy, "search_s": search, "down_s": metrics["retriever/down_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--backoff-s", type=float, default=None, help="retriever.supervisor.backoff_s (default 1.0)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = RetrieverConfig(encoder="bm25", index_type="flat")
    if args.backoff_s is not None:
        cfg.supervisor.backoff_s = args.backoff_s
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        _corpus(corpus, args.docs)
        index = ensure_index(cfg, corpus, os.path.join(tmp, "index"))
        service = RetrieverService(cfg, corpus, index, log_path=os.path.join(tmp, "retriever.log"))
        with service:
            sup = RetrieverSupervisor(service, cfg)
            rows = [trial(service, sup) for _ in range(args.trials)]
    keys = ("healthy_s", "search_s", "down_s")
    sup_cfg = cfg.supervisor
    print(f"{args.docs} docs, BM25, backoff_s={sup_cfg.backoff_s}, check_interval_s={sup_cfg.check_interval_s}")
    print("trial " + " ".join(f"{k:>10}" for k in keys))
    for i, row in enumerate(rows):
        print(f"{i:>5} " + " ".join(f"{row[k]:>10.2f}" for k in keys))
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    print("median" + " ".join(f"{med[k]:>10.2f}" for k in keys))
    print(f"SIGKILL -> searches answered again (median of {args.trials}): {med['search_s']:.2f} s")


if __name__ == "__main__":
    main()
