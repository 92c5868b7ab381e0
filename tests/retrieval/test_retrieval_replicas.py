"""`REPLICAS=2 bash launch/retriever.sh`: the retrieval server on Ray Serve (a real local Ray, two real replicas).

Checks that both replicas answer Search-R1's request format behind one bearer token, and that a replica SIGKILLed
under steady load costs no failed search (the client retries what was in flight) and is replaced by Serve within
60 s. ~60 s (two index loads, Serve start-up, the replacement).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import REPO, Server, _env, free_port, wait_healthy

from retrieval_server.replicas import haproxy_pids
from rsearch_verl.config import RetrieverConfig
from rsearch_verl.search.client import SearchClient

logger = logging.getLogger(__name__)
TOKEN = "replica-test-token"
REPLACE_WITHIN_S = 60.0


@contextlib.contextmanager
def replicated_server(index: Path, replicas: int, log: Path):
    """`REPLICAS=N bash launch/retriever.sh` on a local Ray of its own, until every replica runs; stopped after."""
    port = free_port()
    env = {**_env(), "INDEX_DIR": str(index), "ENCODER": "bm25", "PORT": str(port), "REPLICAS": str(replicas)}
    env["RETRIEVER_TOKEN"] = TOKEN
    env.pop("RAY_ADDRESS", None)  # a local Ray of its own
    with log.open("w") as fh:
        proc = subprocess.Popen(
            ["bash", "launch/retriever.sh"],
            cwd=REPO,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, timeout_s=240)  # the ingress answers once the first replica is up
        deadline = time.monotonic() + 240
        while "Ray Serve replica(s)" not in log.read_text():  # logged once every replica is running
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield Server(url=url, proc=proc, index=index, log=log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the script execs the server: it deletes the app and stops its Ray
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # nothing of the local Ray outlives it: Ray does not stop the HAProxy a worker forked, the server does
        assert not haproxy_on(port), f"an HAProxy still listens on :{port} after the server exited"


@pytest.fixture(scope="module")
def replicated(bm25_index, tmp_path_factory) -> Server:
    with replicated_server(bm25_index, 2, tmp_path_factory.mktemp("replicas") / "serve.log") as server:
        yield server


def haproxy_on(port: int) -> bool:
    """Whether some HAProxy process was started for this port (its config file names the port)."""
    for pid in haproxy_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            conf = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == b"-f"), None)
            if conf is not None and f":{port}".encode() in Path(conf.decode()).read_bytes():
                return True
        except OSError:
            continue
    return False


def replica_pids(url: str, within_s: float = 30.0) -> set[int]:
    """The processes that answer /health (the ingress balances the probes over the replicas; HAProxy adds a
    replica once its own health check passed, a second or two after Serve reports it running)."""
    seen: set[int] = set()
    deadline = time.monotonic() + within_s
    with httpx.Client(timeout=5) as http:
        while len(seen) < 2 and time.monotonic() < deadline:
            try:
                seen.add(http.get(f"{url}/health").json()["pid"])
            except (httpx.HTTPError, KeyError, ValueError):
                time.sleep(0.2)
    return seen


def test_two_replicas_answer_search_r1_requests(replicated):
    assert len(replica_pids(replicated.url)) == 2
    body = {"queries": ["stone bridges", "salt caravans"], "topk": 3, "return_scores": True}  # Search-R1's client
    resp = httpx.post(f"{replicated.url}/retrieve", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 200, resp.text
    result = resp.json()["result"]
    assert len(result) == 2 and all(len(hits) == 3 for hits in result)
    assert {"id", "contents"} <= set(result[0][0]["document"]) and isinstance(result[0][0]["score"], float)
    assert httpx.post(f"{replicated.url}/retrieve", json=body).status_code == 401  # the token guards every replica


def test_a_second_replicated_server_runs_beside_the_first(replicated, tmp_path):
    """Two local Rays on one machine, each with its own Serve and HAProxy (whose stats ports are per machine)."""
    with replicated_server(replicated.index, 1, tmp_path / "second.log") as second:
        assert httpx.get(f"{second.url}/health", timeout=5).json()["pid"] not in replica_pids(replicated.url)
    assert httpx.get(f"{replicated.url}/health", timeout=5).status_code == 200  # the first one is unharmed


class SteadyLoad:
    """4 concurrent searchers through the real client (retries, no cache) in a thread of its own."""

    def __init__(self, url: str):
        self.client = SearchClient(RetrieverConfig(url=url, cache=False, timeout_s=10.0, max_retries=3))
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _searcher(self, k: int) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                docs = await self.client([f"query {k} {i} stone bridges"], 3)
                assert len(docs[0]) == 3
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is what the test reports
                self.failed.append(repr(exc))
            i += 1

    async def _run(self) -> None:
        await asyncio.gather(*(self._searcher(k) for k in range(4)))

    def __enter__(self) -> SteadyLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_killed_replica_is_replaced_under_load_without_failed_searches(replicated, monkeypatch):
    monkeypatch.setenv("RETRIEVER_TOKEN", TOKEN)  # the search client's token
    before = replica_pids(replicated.url)
    assert len(before) == 2
    victim = min(before)
    with SteadyLoad(replicated.url) as load:
        time.sleep(3)
        ok_before_kill = load.ok
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        now: set[int] = set()
        while time.monotonic() - killed_at < REPLACE_WITHIN_S:
            now = replica_pids(replicated.url, within_s=5)
            if len(now) == 2 and victim not in now:
                break
            time.sleep(1)
        replaced_s = time.monotonic() - killed_at
        time.sleep(2)  # load keeps flowing on the replacement
    metrics = load.client.metrics()
    assert len(now) == 2 and victim not in now, f"replica {victim} not replaced within {REPLACE_WITHIN_S} s: {now}"
    assert ok_before_kill > 0 and load.ok > ok_before_kill
    assert load.failed == [], load.failed[:3]
    assert metrics["search/retries"] <= 10, metrics  # only what was in flight on the killed replica
    logger.warning("replaced in %.1f s; %d searches ok, %d retried", replaced_s, load.ok, metrics["search/retries"])


def test_replicas_spread_over_the_nodes_that_fit_one_and_size_threads_to_their_cpus():
    from retrieval_server.config import ServerConfig
    from retrieval_server.replicas import replica_config, spread_cap

    def node(cpus: float, alive: bool = True) -> dict:
        return {"Alive": alive, "Resources": {"CPU": cpus}}

    head, host = node(0), node(1)  # a head with no CPUs holds no replica
    assert spread_cap(2, 1.0, [head, host, host]) == 1
    assert spread_cap(3, 1.0, [head, host, host]) == 2
    assert spread_cap(2, 1.0, [host, node(1, alive=False)]) == 2
    assert spread_cap(2, 2.0, [host, host]) == 2  # none fits: Serve reports the unschedulable replicas itself
    one = replica_config(ServerConfig(token="t"), 1.0)
    four = replica_config(ServerConfig(), 4.0)
    assert (one.cpus, one.workers, one.token) == (1, 1, None)  # the token reaches replicas by their runtime env
    assert (four.cpus, four.workers, four.own_cpus()) == (4, 2, 4)


def test_replicas_of_a_missing_index_fail_in_one_line(tmp_path):
    cmd = [sys.executable, "-m", "retrieval_server", "serve", "--index", str(tmp_path / "none"), "--replicas", "2"]
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "does not exist" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_replicas_refuse_a_gpu_device_in_one_line(bm25_index):
    cmd = [sys.executable, "-m", "retrieval_server", "serve", "--index", str(bm25_index), "--replicas", "2"]
    done = subprocess.run([*cmd, "--device", "cuda"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "CPU only" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_ingress_auto_is_haproxy_where_serve_finds_its_binary(monkeypatch):
    from retrieval_server import replicas

    assert replicas.resolve_ingress("proxy") == "proxy" and replicas.resolve_ingress("haproxy") == "haproxy"
    with pytest.raises(ValueError, match="--ingress must be one of"):
        replicas.resolve_ingress("nginx")
    monkeypatch.setattr(replicas.sys, "platform", "darwin")  # ray[serve] bundles HAProxy for Linux only
    monkeypatch.setattr(replicas.shutil, "which", lambda name: None)
    assert replicas.resolve_ingress("auto") == "proxy"
    monkeypatch.setattr(replicas.shutil, "which", lambda name: "/usr/sbin/haproxy" if name == "haproxy" else None)
    assert replicas.resolve_ingress("auto") == "haproxy"


def test_sigterm_while_deploying_stops_at_once_and_leaves_no_haproxy(bm25_index, tmp_path):
    """A server told to stop before its replicas run (e.g. the trainer giving up on a slow start) does not wait for
    the deployment: it exits within seconds, its local Ray and HAProxy gone."""
    port = free_port()
    env = {**_env(), "RETRIEVER_TOKEN": TOKEN}
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "retrieval_server", "serve", "--index", str(bm25_index), "--replicas", "2"]
    with log.open("w") as fh:
        proc = subprocess.Popen([*cmd, "--port", str(port)], cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while "Started Serve" not in log.read_text():  # Serve and its ingress are up, the replicas are being deployed
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    assert "replica(s)" not in log.read_text()
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not haproxy_on(port), f"an HAProxy still listens on :{port}"
