"""Record and replay of search results (rsearch_verl/search/replay.py, store.py) against a real retrieval server.

Two BM25 indexes over different synthetic corpora are built with `retrieval_server.build.build_index` and served by
the real app (`create_app`) under uvicorn on 127.0.0.1, behind an ASGI wrapper that counts the requests per path, so
"a replayed run makes no network call" is checked on the server's side. Pages of whole documents (`documents()`, the
open tool) are recorded and replayed against a real `python -m retrieval_server serve` of a chunked index (the
long-document fixtures of tests/retrieval/conftest.py, loaded from there). The concurrent-writer test runs two real
writer processes on one store and SIGKILLs one of them mid-run.
Run: .venv/bin/python -m pytest -q tests/search/test_record_replay.py
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import importlib.util
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rsearch_verl.config import BreakerConfig, ConfigError, RetrieverConfig, load_config
from rsearch_verl.rollout.agent_loop import CountingSearch
from rsearch_verl.rollout.protocols.search_r1 import SearchR1Protocol
from rsearch_verl.search import SearchClient, SearchError
from rsearch_verl.search.breaker import CircuitBreaker
from rsearch_verl.search.replay import RecordReplay, page_key, search_key
from rsearch_verl.search.service import RetrieverService, free_port
from rsearch_verl.search.sources import Source
from rsearch_verl.search.store import ResultStore, StoreMismatchError
from rsearch_verl.search.types import Doc, DocumentPage
from rsearch_verl.testing.servers import serve_in_thread
from rsearch_verl.trainer.preflight import PreflightError, check_record_replay, preflight

REPO = Path(__file__).resolve().parents[2]
N_DOCS = 120


def _retrieval_fixtures():
    """tests/retrieval/conftest.py as a module: its session fixtures (a served chunked index) are reused here."""
    spec = importlib.util.spec_from_file_location("retrieval_conftest", REPO / "tests" / "retrieval" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_retrieval = _retrieval_fixtures()
# the fixtures chunked_server needs, by name (pytest finds fixtures among a test module's globals)
start_server, documents_corpus, chunked_index, chunked_server = (
    _retrieval.start_server,
    _retrieval.documents_corpus,
    _retrieval.chunked_index,
    _retrieval.chunked_server,
)


class CountingApp:
    """An ASGI wrapper counting HTTP requests per path (what reached the server)."""

    def __init__(self, app):
        self.app, self.paths = app, collections.Counter()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.paths[scope["path"]] += 1
        await self.app(scope, receive, send)


@dataclasses.dataclass
class Live:
    url: str
    app: CountingApp
    fingerprint: str
    queries: list[str]


def _serve(tmp: Path, seed: int):
    from retrieval_server.app import create_app
    from retrieval_server.build import build_index
    from retrieval_server.config import ServerConfig
    from retrieval_server.corpus import make_synthetic_corpus
    from retrieval_server.retriever import load_retriever

    corpus = tmp / f"corpus{seed}.jsonl"
    pairs = make_synthetic_corpus(str(corpus), N_DOCS, seed=seed)
    index = build_index(str(corpus), "bm25", "flat", str(tmp / f"bm25_{seed}"))
    retriever = load_retriever(index)
    app = CountingApp(create_app(ServerConfig(), retriever))
    srv, thread, url = serve_in_thread(app)
    return srv, thread, Live(url, app, retriever.info["fingerprint"], [q for q, _ in pairs[:12]])


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> dict[str, Live]:
    tmp = tmp_path_factory.mktemp("record_replay")
    started = {name: _serve(tmp, seed) for name, seed in (("a", 0), ("b", 1))}
    yield {name: live for name, (_, _, live) in started.items()}
    for srv, thread, _ in started.values():
        srv.should_exit = True
        thread.join(timeout=10)


def _client(**cfg) -> SearchClient:
    return SearchClient(RetrieverConfig(**{"timeout_s": 5.0, "max_retries": 0, "cache": False, **cfg}), backoff_s=0.01)


async def _run(client: SearchClient, batches: list[list[str]], topk: int = 3):
    try:
        return [await client(queries, topk) for queries in batches]
    finally:
        await client.aclose()


def _record(live: Live, path: Path, queries: list[str]) -> SearchClient:
    client = _client(url=live.url, record=str(path))
    asyncio.run(_run(client, [queries[:4], queries[2:8], [queries[0]]]))
    return client


def test_health_reports_a_stable_fingerprint(servers, tmp_path):
    from retrieval_server.build import build_index
    from retrieval_server.corpus import make_synthetic_corpus
    from retrieval_server.retriever import read_manifest

    a, b = servers["a"], servers["b"]
    health = httpx.get(f"{a.url}/health", timeout=5).json()
    assert health["fingerprint"] == a.fingerprint and a.fingerprint.startswith("sha256:")
    assert a.fingerprint != b.fingerprint
    make_synthetic_corpus(str(tmp_path / "c.jsonl"), N_DOCS, seed=0)  # the same corpus, built again elsewhere
    again = build_index(str(tmp_path / "c.jsonl"), "bm25", "flat", str(tmp_path / "again"))
    assert read_manifest(again)["fingerprint"] == a.fingerprint


def test_record_then_replay_gives_the_same_results_without_the_server(servers, tmp_path):
    live, store = servers["a"], tmp_path / "runs" / "searches.sqlite"
    queries = live.queries
    recorder = _record(live, store, queries)
    m = recorder.metrics()
    assert m["search/record_writes"] == 8 and m["search/store_entries"] == 8  # 8 distinct queries
    assert m["search/errors"] == 0
    expected = asyncio.run(_run(_client(url=live.url), [queries[:8], [queries[3]]]))
    assert all(docs for docs in expected[0])

    before = sum(live.app.paths.values())
    # the retriever "down": retriever.url points at nothing; replay-only must not even try it
    replayer = _client(url=f"http://127.0.0.1:{free_port()}", replay=str(store))
    assert asyncio.run(_run(replayer, [queries[:8], [queries[3]]])) == expected  # every Doc field, scores included
    m = replayer.metrics()
    assert m["search/replay_hits"] == 9 and m["search/replay_misses"] == 0 and m["search/errors"] == 0
    assert m["search/requests"] == 0 and m["search/store_entries"] == 8
    no_url = _client(replay=str(store))  # and with no retriever.url at all (the run started none)
    assert asyncio.run(_run(no_url, [queries[:8]]))[0] == expected[0]
    assert sum(live.app.paths.values()) == before  # not one request reached the server


def test_replay_miss_error_is_an_error_observation(servers, tmp_path):
    live, store = servers["a"], tmp_path / "s.sqlite"
    _record(live, store, live.queries)
    client = _client(replay=str(store), replay_miss="error")
    with pytest.raises(SearchError) as info:
        asyncio.run(_run(client, [["a query nobody recorded"]]))
    assert info.value.kind == "replay_miss" and not info.value.outage
    m = client.metrics(reset=True)
    assert m["search/replay_misses"] == 1 and m["search/errors"] == 1 and m["search/requests"] == 0

    # through the rollout's wrappers: the breaker lets it through untouched, the protocol observes it, it is counted
    protocol = SearchR1Protocol()
    counted = CountingSearch(CircuitBreaker(client, BreakerConfig(min_calls=1, window=1), probe=client.healthy))

    async def observe(text: str) -> str:
        try:
            return await protocol.observe(protocol.parse_turn(f"<search> {text} </search>"), counted, 3)
        finally:
            await client.aclose()

    assert "search failed: replay_miss" in asyncio.run(observe("not recorded either"))
    assert "Doc 1(Title:" in asyncio.run(observe(live.queries[0]))
    assert counted.errors == 1 and counted.outages == 0
    assert client.metrics()["search/replay_hits"] == 1


def test_replay_miss_live_asks_the_retriever_and_records(servers, tmp_path):
    live, store = servers["a"], tmp_path / "s.sqlite"
    _record(live, store, live.queries[:4])
    retrieves = live.app.paths["/retrieve"]
    client = _client(url=live.url, replay=str(store), record=str(store), replay_miss="live")
    asyncio.run(_run(client, [live.queries[:4]]))  # all recorded: no request, not even /health
    assert live.app.paths["/retrieve"] == retrieves
    asyncio.run(_run(client, [live.queries[3:6]]))  # one hit, two misses asked live and recorded
    m = client.metrics()
    assert m["search/replay_hits"] == 5 and m["search/replay_misses"] == 2 and m["search/record_writes"] == 2
    assert m["search/store_entries"] == 6 and m["search/requests"] == 1
    assert live.app.paths["/retrieve"] == retrieves + 1

    replayer = _client(replay=str(store))
    asyncio.run(_run(replayer, [live.queries[:6]]))
    assert replayer.metrics()["search/replay_hits"] == 6


def test_a_store_is_pinned_to_its_index(servers, tmp_path):
    a, b = servers["a"], servers["b"]
    store = tmp_path / "a.sqlite"
    _record(a, store, a.queries)
    assert ResultStore(str(store)).fingerprint == a.fingerprint
    for cfg in ({"replay": str(store), "replay_miss": "live"}, {"record": str(store)}):
        client = _client(url=b.url, **cfg)
        with pytest.raises(StoreMismatchError) as info:
            asyncio.run(_run(client, [[b.queries[0]]]))
        assert a.fingerprint in str(info.value) and b.fingerprint in str(info.value)
    # the driver's preflight says the same before any worker starts (an external retriever.url)
    health = httpx.get(f"{b.url}/health", timeout=5).json()
    with pytest.raises(PreflightError) as info:
        check_record_replay(RetrieverConfig(url=b.url, replay=str(store), replay_miss="live"), health)
    assert a.fingerprint in str(info.value) and b.fingerprint in str(info.value)
    with pytest.raises(PreflightError, match="recorded against"):  # replay-only with a reachable, other index
        check_record_replay(RetrieverConfig(url=b.url, replay=str(store)), None)
    check_record_replay(RetrieverConfig(url=a.url, replay=str(store)), None)


def test_replay_only_run_needs_no_retriever(tmp_path):
    store = tmp_path / "s.sqlite"
    ResultStore(str(store)).pin("sha256:recorded")
    dead = f"http://127.0.0.1:{free_port()}"
    retriever = RetrieverConfig(url=dead, replay=str(store), replay_miss="error", preflight_wait_s=30.0)
    assert retriever.replay_only
    with RetrieverService(retriever, corpus=None, index_dir=None) as url:  # no corpus, no index: nothing to start
        assert url is None
    service = RetrieverService(RetrieverConfig(replay=str(store)), corpus=None, index_dir=None)
    assert not service.needed and not service.owned and service.alive()
    overrides = [f"retriever.url={dead}", f"retriever.replay={store}", "retriever.preflight_wait_s=30"]
    cfg = load_config(["+recipe=search_r1_ppo", *overrides])
    assert cfg.retriever.replay_only
    start = time.monotonic()
    preflight(cfg, str(tmp_path / "run"))  # a dead retriever.url is not waited for (retriever.preflight_wait_s)
    assert time.monotonic() - start < 10
    with pytest.raises(PreflightError, match="no record/replay store"):
        check_record_replay(RetrieverConfig(replay=str(tmp_path / "missing.sqlite")), None)


def test_config_validation():
    with pytest.raises(ConfigError, match="retriever.replay_miss"):
        load_config(["+recipe=search_r1_ppo", "retriever.replay=x.sqlite", "retriever.replay_miss=skip"])
    with pytest.raises(ConfigError, match="retriever.record"):  # replay-only records nothing
        load_config(["+recipe=search_r1_ppo", "retriever.record=x.sqlite", "retriever.replay=y.sqlite"])
    ok = ["retriever.record=x.sqlite", "retriever.replay=x.sqlite", "retriever.replay_miss=live"]
    cfg = load_config(["+recipe=search_r1_ppo", *ok])
    assert cfg.retriever.replay == "x.sqlite" and not cfg.retriever.replay_only
    assert load_config(["+recipe=search_r1_ppo"]).retriever.record is None  # unset by default


def test_metrics_window(tmp_path):
    """The record / replay counters of one window, the store's size, and no new keys without record / replay."""
    assert not any("replay" in k or "record" in k or "store" in k for k in _client(url="http://x").metrics())
    path = str(tmp_path / "m.sqlite")
    rr = RecordReplay(RetrieverConfig(record=path, replay=path, replay_miss="live"))

    async def live_fp() -> str:
        return "sha256:abc"

    async def go():
        await rr.ensure_pinned(live_fp)
        await rr.record("local", 2, ["q1", "q2"], [[], []])
        await rr.record("local", 2, ["q1"], [[]])  # already there: not a write
        return rr.lookup("local", 2, ["q1", "q3"])

    assert asyncio.run(go()) == [[], None]
    assert rr.metrics(reset=True) == {
        "search/replay_hits": 1.0,
        "search/replay_misses": 1.0,
        "search/record_writes": 2.0,
        "search/store_entries": 2.0,
    }
    assert rr.metrics()["search/record_writes"] == 0.0 and rr.metrics()["search/store_entries"] == 2.0
    assert ResultStore(path).get_many([search_key("sha256:abc", "local", 2, "q2")]) == [[]]

    async def one_batch(i: int):  # a rollout batch: a fresh event loop each time
        await rr.record("local", 2, [f"batch {i}"], [[]])
        return rr.lookup("local", 2, [f"batch {i}"])

    assert all(asyncio.run(one_batch(i)) == [[]] for i in range(20))
    assert len(rr.store._conns) <= 2  # the writer thread's and this one's: no connection left behind per loop
    rr.close()


def _docs_client(url: str, **cfg) -> SearchClient:
    return _client(url=url, token=_retrieval.DOCS_TOKEN, **cfg)


def _pages(client: SearchClient, calls: list[tuple[list[str], int]]):
    async def go():
        try:
            return [await client.documents(ids, page) for ids, page in calls]
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_documents_are_recorded_and_replayed(chunked_server, tmp_path):
    store, fingerprint = tmp_path / "docs.sqlite", chunked_server.health()["fingerprint"]
    calls = [(["atlas", "short"], 0), (["atlas"], 1), (["borealis", "atlas"], 0)]
    recorder = _docs_client(chunked_server.url, record=str(store))
    recorded = _pages(recorder, calls)
    m = {**recorder.metrics(), **recorder.document_metrics()}
    assert m["search/record_writes"] == 4 and m["search/store_entries"] == 4  # (atlas, 0) once
    assert m["documents/requests"] == 3 and m["documents/errors"] == 0
    with pytest.raises(SearchError) as unknown:  # an error is not recorded
        _pages(recorder, [(["no-such-doc"], 0)])
    assert unknown.value.kind == "http_404" and len(ResultStore(str(store))) == 4
    key = page_key(fingerprint, "local", "atlas", 1)
    assert key == {"tool": "open", "source": "local", "index": fingerprint, "id": "atlas", "page": 1}
    assert ResultStore(str(store)).get_many([key]) == [dataclasses.asdict(recorded[1][0])]

    # replay-only, the retriever "down": the same pages in the order asked, no request
    replayer = _docs_client(f"http://127.0.0.1:{free_port()}", replay=str(store))
    assert _pages(replayer, [*calls, (["short", "borealis"], 0)]) == [*recorded, [recorded[0][1], recorded[2][0]]]
    m = {**replayer.metrics(), **replayer.document_metrics()}
    assert m["search/replay_hits"] == 7 and m["search/replay_misses"] == 0 and m["documents/requests"] == 0
    with pytest.raises(SearchError) as miss:
        _pages(replayer, [(["atlas", "borealis"], 2)])  # page 2 of atlas was never opened
    assert miss.value.kind == "replay_miss" and not miss.value.outage
    m = {**replayer.metrics(), **replayer.document_metrics()}
    assert m["search/replay_misses"] == 2 and m["documents/errors"] == 1 and m["documents/requests"] == 0

    # replay_miss=live: only the missing page is asked of the server, and recorded
    live = _docs_client(chunked_server.url, replay=str(store), record=str(store), replay_miss="live")
    both = _pages(live, [(["atlas", "borealis"], 1)])[0]
    assert both[0] == recorded[1][0] and (both[1].id, both[1].page) == ("borealis", 1)
    m = {**live.metrics(), **live.document_metrics()}
    assert m["search/replay_hits"] == 1 and m["search/replay_misses"] == 1 and m["search/record_writes"] == 1
    assert m["documents/requests"] == 1 and m["search/store_entries"] == 5


def test_documents_pinned_to_the_index(chunked_server, servers, tmp_path):
    """A store recorded against another index stops documents() too (StoreMismatchError naming both)."""
    a, store = servers["a"], tmp_path / "a.sqlite"
    _record(a, store, a.queries)
    client = _docs_client(chunked_server.url, replay=str(store), replay_miss="live")
    with pytest.raises(StoreMismatchError) as info:
        _pages(client, [(["atlas"], 0)])
    assert a.fingerprint in str(info.value) and chunked_server.health()["fingerprint"] in str(info.value)


class _SlowSource(Source):
    """A search source answering after `delay_s` (the cost is the time inside the client's calls)."""

    name, batched = "slow", True

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    async def search(self, http, queries, topk, timeout_s):
        await asyncio.sleep(self.delay_s)
        return [[Doc(id=q, contents=q, source=self.name)] for q in queries]

    async def documents(self, http, ids, page, timeout_s):
        await asyncio.sleep(self.delay_s)
        return [DocumentPage(id=i, contents=i, page=page, pages=1) for i in ids]


def test_search_cost_per_source():
    """search/cost_s sums the seconds inside calls (concurrent ones each count) and calls per source, per window;
    every known source is reported (0 when not asked) so that every rollout worker reports the same keys."""
    client = SearchClient(RetrieverConfig(cache=False), {"slow": _SlowSource(0.05)}, coalesce=False)

    async def go():
        await asyncio.gather(*(client([f"q{i}"], 1, source="slow") for i in range(3)))
        with pytest.raises(SearchError):  # an unknown source is a call too (and an error)
            await client(["q"], 1, source="nowhere")
        await client.documents(["d"], 0, source="slow")
        await client.aclose()

    asyncio.run(go())
    m, d = client.metrics(reset=True), client.document_metrics(reset=True)
    assert 0.15 <= m["search/cost_s"] < 1.0 and m["search/calls/slow"] == 3 and m["search/calls/other"] == 1
    assert m["search/calls/local"] == 0 and {"search/calls/arxiv", "search/calls/web"} <= m.keys()
    assert 0.05 <= d["documents/cost_s"] < 0.5 and d["documents/calls/slow"] == 1
    again = client.metrics()
    assert again["search/cost_s"] == 0 and again["search/calls/slow"] == 0  # a new window
    assert again.keys() == m.keys()


WRITER = """
import hashlib, sys
from rsearch_verl.search.store import ResultStore
path, name, n, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = ResultStore(path)
i = 0
while n < 0 or i < n:
    items = []
    for _ in range(batch):
        payload = hashlib.sha256(f"{name}{i}".encode()).hexdigest() * 64  # 4 KB a result
        sha = hashlib.sha256(payload.encode()).hexdigest()
        items.append(({"tool": "test", "writer": name, "i": i}, {"payload": payload, "sha": sha}))
        i += 1
    store.put_many(items)
"""


def test_concurrent_writers_one_killed_mid_run(tmp_path):
    path, batch, survivor_n = tmp_path / "shared" / "store.sqlite", 8, 3000
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}

    def writer(name: str, n: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, str(n), str(batch)], cwd=REPO, env=env)

    survivor, victim = writer("survivor", survivor_n), writer("victim", -1)  # both create the file at once
    try:
        deadline = time.monotonic() + 120
        while _count(path, "victim") < 40 * batch and time.monotonic() < deadline:
            assert victim.poll() is None and survivor.poll() in (None, 0)
            time.sleep(0.02)
        assert survivor.poll() is None  # both are writing
        os.kill(victim.pid, signal.SIGKILL)  # mid-run, most likely inside a transaction
        assert victim.wait(timeout=10) == -signal.SIGKILL
        assert survivor.wait(timeout=180) == 0
    finally:
        for proc in (survivor, victim):
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    per_writer = collections.defaultdict(set)
    for key, value in conn.execute("SELECT key, value FROM entries"):
        request, result = json.loads(key), json.loads(value)  # every entry parses
        assert hashlib.sha256(result["payload"].encode()).hexdigest() == result["sha"]  # and is whole
        per_writer[request["writer"]].add(request["i"])
    conn.close()
    assert per_writer["survivor"] == set(range(survivor_n))
    n_victim = len(per_writer["victim"])
    # each put_many is one transaction: the killed writer left whole batches, the first n of them
    assert n_victim >= 40 * batch and n_victim % batch == 0 and per_writer["victim"] == set(range(n_victim))
    assert len(ResultStore(str(path))) == survivor_n + n_victim  # and the store opens again for more


def _count(path: Path, name: str) -> int:
    if not path.exists():
        return 0
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            like = f'%"writer":"{name}"%'
            return conn.execute("SELECT count(*) FROM entries WHERE key LIKE ?", (like,)).fetchone()[0]
        finally:
            conn.close()
    except sqlite3.OperationalError:  # not created yet
        return 0
