"""Fixtures for the retrieval-server tests: small indexes built once per session, real server subprocesses.

`retrieval_corpus` writes a synthetic corpus with planted relevant passages; `minilm_index` / `bm25_index` build it
through the real CLI (`python -m retrieval_server build`); `start_server(index, *flags)` runs
`python -m retrieval_server serve` on a free 127.0.0.1 port, waits for GET /health and terminates it at the end.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
N_DOCS = 400
SERVER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    index: Path
    log: Path  # the server's stdout + stderr (a file, so a chatty server never blocks on a full pipe)

    def health(self) -> dict:
        resp = httpx.get(f"{self.url}/health", timeout=10)
        resp.raise_for_status()
        return resp.json()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {**os.environ, **SERVER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.pop("RETRIEVER_TOKEN", None)
    return env


def run_build(corpus: Path, encoder: str, out: Path) -> Path:
    cmd = [sys.executable, "-m", "retrieval_server", "build", "--corpus", str(corpus), "--encoder", encoder]
    cmd += ["--index-type", "flat", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"build failed:\n{proc.stdout}\n{proc.stderr}"
    assert (out / "manifest.json").exists()
    return out


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"server at {url} not healthy after {timeout_s} s")


@pytest.fixture(scope="session")
def retrieval_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[str, str]]]:
    from retrieval_server.corpus import make_synthetic_corpus

    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    pairs = make_synthetic_corpus(str(path), N_DOCS, seed=0)
    return path, pairs


@pytest.fixture(scope="session")
def minilm_index(retrieval_corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_build(retrieval_corpus[0], "minilm", tmp_path_factory.mktemp("idx") / "minilm_flat")


@pytest.fixture(scope="session")
def bm25_index(retrieval_corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_build(retrieval_corpus[0], "bm25", tmp_path_factory.mktemp("idx") / "bm25")


@pytest.fixture(scope="session")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    """Factory: start_server(index_dir, "--token", "t", ...) -> Server (stopped at session end); `module=` another
    server with the same flags (the baseline: rsearch_verl.testing.searchr1_server)."""
    procs: list[subprocess.Popen] = []
    log_dir = tmp_path_factory.mktemp("server_logs")

    def start(index: Path, *flags: str, module: str = "retrieval_server serve") -> Server:
        port = free_port()
        cmd = [sys.executable, "-m", *module.split(), "--index", str(index), "--port", str(port), *flags]
        log = log_dir / f"server_{port}.log"
        with log.open("w") as fh:
            proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=fh, stderr=subprocess.STDOUT)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log)
        return Server(url=url, proc=proc, index=index, log=log)

    yield start
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def minilm_server(start_server, minilm_index) -> Server:
    return start_server(minilm_index)


@pytest.fixture(scope="session")
def bm25_server(start_server, bm25_index) -> Server:
    return start_server(bm25_index)


@pytest.fixture(scope="session")
def token_server(start_server, bm25_index) -> Server:
    """BM25 server with bearer auth on (token given on the command line)."""
    return start_server(bm25_index, "--token", "test-token", "--max-queries", "8", "--max-topk", "20")


@pytest.fixture(scope="session")
def searchr1_server(start_server, minilm_index) -> Server:
    """The same MiniLM index served by the Search-R1-like baseline (rsearch_verl/testing/searchr1_server.py)."""
    return start_server(minilm_index, module="rsearch_verl.testing.searchr1_server")
