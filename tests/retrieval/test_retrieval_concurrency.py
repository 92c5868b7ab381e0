"""Concurrency: hundreds of parallel requests give exactly the sequential answers, coalesced into few searches;
plus the MicroBatcher's own rules (adaptive dispatch, batch bound, error isolation) on a plain batch function.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from retrieval_server.batching import MicroBatcher

N_PARALLEL = 240


def _requests(pairs: list[tuple[str, str]]) -> list[dict]:
    """Mixed shapes: 1-3 queries per request, topk 1-5, with and without scores."""
    out = []
    for i in range(N_PARALLEL):
        queries = [pairs[(i + j) % len(pairs)][0] for j in range(1 + i % 3)]
        out.append({"queries": queries, "topk": 1 + i % 5, "return_scores": i % 2 == 0})
    return out


def _ids(result: list, with_scores: bool) -> list[list[str]]:
    return [[(d["document"] if with_scores else d)["id"] for d in docs] for docs in result]


async def _fire_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(client.post("/retrieve", json=b) for b in bodies))


@pytest.mark.parametrize("server_name", ["minilm_server", "bm25_server"])
def test_parallel_equals_sequential(server_name, request, retrieval_corpus):
    server = request.getfixturevalue(server_name)
    bodies = _requests(retrieval_corpus[1])
    with httpx.Client(base_url=server.url, timeout=60) as client:
        sequential = [client.post("/retrieve", json=b).json()["result"] for b in bodies]
    before = server.health()["batching"]
    responses = asyncio.run(_fire_all(server.url, bodies))
    after = server.health()["batching"]
    assert [r.status_code for r in responses] == [200] * len(bodies)
    for body, seq, resp in zip(bodies, sequential, responses, strict=True):
        par = resp.json()["result"]
        assert _ids(par, body["return_scores"]) == _ids(seq, body["return_scores"])
        assert all(len(docs) == body["topk"] for docs in par)
        if body["return_scores"]:  # a batched forward may differ from a single one in the last bits only
            for dp, ds in zip(par, seq, strict=True):
                assert [d["score"] for d in dp] == pytest.approx([d["score"] for d in ds], abs=1e-4)
    # The parallel burst was coalesced: far fewer searches than requests, and no failed batch.
    jobs = after["jobs"] - before["jobs"]
    batches = after["batches"] - before["batches"]
    assert jobs == len(bodies)
    assert batches < len(bodies) / 3, (batches, jobs)
    assert after["errors"] == 0


def _run(coro):
    return asyncio.run(coro)


def test_batcher_adaptive_dispatch_and_bound():
    calls: list[list[int]] = []
    gate = threading.Event()

    def run_batch(items: list[int]) -> list[int]:
        calls.append(list(items))
        gate.wait(5)  # the first batch blocks until everything else has queued
        return [x * 10 for x in items]

    async def main() -> list[int]:
        batcher = MicroBatcher(run_batch, batch_max=4, batch_wait_ms=0)
        first = asyncio.ensure_future(batcher.submit(0, n_queries=1))
        await asyncio.sleep(0.05)
        assert calls == [[0]]  # idle worker: dispatched at once, alone
        rest = [asyncio.ensure_future(batcher.submit(i, n_queries=1)) for i in range(1, 10)]
        await asyncio.sleep(0.05)
        gate.set()
        out = await asyncio.gather(first, *rest)
        batcher.close()
        return out

    assert _run(main()) == [x * 10 for x in range(10)]
    # Queued while busy, then sent in bounded batches (<= 4 queries), in order.
    assert calls == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]


def test_batcher_wait_window_gathers_a_burst():
    calls: list[list[int]] = []

    def run_batch(items: list[int]) -> list[int]:
        calls.append(list(items))
        return items

    async def main() -> None:
        batcher = MicroBatcher(run_batch, batch_max=64, batch_wait_ms=50)
        t0 = time.monotonic()
        first = asyncio.ensure_future(batcher.submit(0, n_queries=1))
        await asyncio.sleep(0.01)
        rest = [batcher.submit(i, n_queries=2) for i in range(1, 4)]
        assert await asyncio.gather(first, *rest) == [0, 1, 2, 3]
        assert time.monotonic() - t0 < 2.0
        batcher.close()

    _run(main())
    assert calls == [[0, 1, 2, 3]]


def test_batcher_error_fails_its_batch_only():
    def run_batch(items: list[str]) -> list[str]:
        if "boom" in items:
            raise ValueError("broken batch")
        return [s.upper() for s in items]

    async def main() -> None:
        batcher = MicroBatcher(run_batch, batch_max=1)
        with pytest.raises(ValueError, match="broken batch"):
            await batcher.submit("boom", n_queries=1)
        assert await batcher.submit("ok", n_queries=1) == "OK"
        # A job bigger than batch_max still runs, alone.
        assert await batcher.submit("big", n_queries=5) == "BIG"
        assert batcher.stats.errors == 1 and batcher.stats.batches == 3
        batcher.close()
        with pytest.raises(RuntimeError, match="closed"):
            await batcher.submit("late", n_queries=1)

    _run(main())


def test_batcher_second_worker_starts_only_with_enough_queries():
    calls: list[list[int]] = []
    started: list[int] = []  # on_start's argument: batches running when each batch began
    gate = threading.Event()

    def run_batch(items: list[int]) -> list[int]:
        calls.append(list(items))
        gate.wait(5)
        return [x + 100 for x in items]

    async def main() -> list[int]:
        # batch_max 8 -> a second concurrent batch needs >= 2 queued queries
        batcher = MicroBatcher(run_batch, batch_max=8, workers=2, on_start=started.append)
        first = asyncio.ensure_future(batcher.submit(0, n_queries=1))
        await asyncio.sleep(0.05)
        lone = asyncio.ensure_future(batcher.submit(1, n_queries=1))
        await asyncio.sleep(0.05)
        assert calls == [[0]]  # one query queued while a batch runs: it waits
        pair = asyncio.ensure_future(batcher.submit(2, n_queries=1))
        await asyncio.sleep(0.05)
        assert calls == [[0], [1, 2]]  # two queued: the idle second worker takes them, concurrently
        gate.set()
        out = await asyncio.gather(first, lone, pair)
        batcher.close()
        return out

    assert _run(main()) == [100, 101, 102]
    assert started == [1, 2]
