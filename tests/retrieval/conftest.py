"""Fixtures for the retrieval-server tests: small indexes built once per session, real server subprocesses.

`retrieval_corpus` writes a synthetic corpus with planted relevant passages; `minilm_index` / `bm25_index` build it
through the real CLI (`python -m retrieval_server build`); `start_server(index, *flags)` runs
`python -m retrieval_server serve` on a free 127.0.0.1 port, waits for GET /health and terminates it at the end.
"""

from __future__ import annotations

import json
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


def run_build(corpus: Path, encoder: str, out: Path, *flags: str) -> Path:
    cmd = [sys.executable, "-m", "retrieval_server", "build", "--corpus", str(corpus), "--encoder", encoder]
    cmd += ["--index-type", "flat", "--out", str(out), *flags]
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


# ---- long documents (build --chunk-tokens, POST /documents): tests/retrieval/test_retrieval_documents*.py ----------
CHUNK_TOKENS = 50
PAGE_TOKENS = 100
DOCS_TOKEN = "doc-token"
_VOCAB = ["river", "stone", "market", "lantern", "harbor", "meadow", "copper", "orchard", "signal", "bridge"]
_VOCAB += ["winter", "garden", "naïve", "café", "東京"]
# planted phrases (unique in the corpus): (document, word position, phrase)
PLANTED = [
    ("atlas", 612, "quokka saffron lighthouse"),
    ("borealis", 5, "zeppelin marmalade"),
    ("wiki:Café Ünïcode", 200, "pangolin tessellation"),
]


def _long_text(seed: int, n_words: int, planted: list[tuple[int, str]]) -> str:
    """`n_words` words with paragraph breaks, doubled spaces and a final newline (reassembled pages must keep them)."""
    import random

    rng = random.Random(seed)
    words = [rng.choice(_VOCAB) for _ in range(n_words)]
    for pos, phrase in planted:
        words[pos : pos + len(phrase.split())] = phrase.split()
    seps = ["\n\n" if i % 37 == 36 else "  " if i % 11 == 10 else " " for i in range(n_words)]
    return "".join(w + s for w, s in zip(words, seps, strict=True)).rstrip() + "\n"


def make_documents_corpus(path: Path) -> dict[str, str]:
    """A few long documents (and a short one, a title-only one, ids with spaces, unicode and '#'); returns
    {id: contents} in corpus order."""
    sizes = {"atlas": 730, "borealis": 420, "wiki:Café Ünïcode": 260, "delta#7": 120, "short": 12}
    docs = {}
    for seed, (doc_id, n) in enumerate(sizes.items()):
        planted = [(pos, phrase) for d, pos, phrase in PLANTED if d == doc_id]
        docs[doc_id] = f'"{doc_id.title()}"\n' + _long_text(seed, n, planted)
    docs["empty"] = '"Empty page"\n'
    with path.open("w", encoding="utf-8") as fh:
        for doc_id, contents in docs.items():
            fh.write(json.dumps({"id": doc_id, "contents": contents}, ensure_ascii=False) + "\n")
    return docs


@pytest.fixture(scope="session")
def documents_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    path = tmp_path_factory.mktemp("documents") / "documents.jsonl"
    return path, make_documents_corpus(path)


@pytest.fixture(scope="session")
def chunked_index(documents_corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("idx") / "bm25_chunked"
    return run_build(documents_corpus[0], "bm25", out, "--chunk-tokens", str(CHUNK_TOKENS))


@pytest.fixture(scope="session")
def unchunked_index(documents_corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_build(
        documents_corpus[0], "bm25", tmp_path_factory.mktemp("idx") / "bm25_unchunked", "--chunk-tokens", "0"
    )


@pytest.fixture(scope="session")
def chunked_server(start_server, chunked_index) -> Server:
    """The chunked BM25 index, pages of PAGE_TOKENS words, at most 4 ids per /documents, bearer token DOCS_TOKEN."""
    return start_server(
        chunked_index, "--page-tokens", str(PAGE_TOKENS), "--max-document-ids", "4", "--token", DOCS_TOKEN
    )


@pytest.fixture(scope="session")
def unchunked_server(start_server, unchunked_index) -> Server:
    return start_server(unchunked_index, "--page-tokens", str(PAGE_TOKENS))
