"""The preflight on the real main job: what is wrong with the set-up stops the run in seconds, before the warm start.

1. The README job with a dead `retriever.url` and an EMPTY toy-world cache (so the warm start would be built: ~10 min
   on a busy 2-core machine, ~2 min without it) exits 3 in under 2 minutes with a message naming retriever.url.
2. An external retrieval server started with `--token` and a run whose RETRIEVER_TOKEN is wrong: exit 3 naming
   RETRIEVER_TOKEN, and neither token appears in the run's output.
3. A 1-step run with RETRIEVER_TOKEN set (the recipe's own server then requires it): it finishes, the driver logs that
   it forwards the variable (by name), and config.yaml, the run directory's logs and the output hold no token. (Its
   random tiny policy rarely searches, so this is the leak check, not the proof that workers authenticate: that is
   tests/trainer/test_preflight.py on the runtime env and tests/retrieval/test_search_auth.py on the client.)

Wall times are logged (pytest -o log_cli=true --log-cli-level=INFO).
Run: .venv/bin/python -m pytest -q -m slow tests/e2e/test_e2e_preflight.py
"""

from __future__ import annotations

import glob
import logging
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from e2e_helpers import ROOT, child_env, run_main

logger = logging.getLogger(__name__)


def _dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _main(overrides: list[str], env: dict | None = None, timeout: int = 300):
    cmd = [sys.executable, "-m", "rsearch_verl.main", "+recipe=search_r1_ppo", *overrides]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=child_env(env), capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - start


@pytest.mark.slow
def test_dead_retriever_url_stops_the_readme_job_fast(tmp_path):
    url = _dead_url()
    cache = tmp_path / "empty_toy_cache"  # fresh: the warm start would be built from nothing
    overrides = [f"retriever.url={url}", f"data.toy_world.cache_dir={cache}", f"trainer.run_dir={tmp_path / 'run'}"]
    done, took = _main(overrides, timeout=600)
    logger.info("dead retriever.url: exit %d after %.1f s", done.returncode, took)
    assert done.returncode == 3, done.stderr[-3000:]
    assert f"retriever.url={url}" in done.stderr and "does not answer GET /health" in done.stderr
    assert "waiting for retriever.url" in done.stderr
    assert took < 120, took
    assert not os.path.exists(os.path.join(cache, "warm_start")) and not glob.glob(f"{cache}/**/*.safetensors")


@pytest.fixture
def token_server(tmp_path):
    """`python -m retrieval_server serve --token` over a small BM25 index (built here)."""
    from retrieval_server.corpus import make_synthetic_corpus

    corpus, index = tmp_path / "corpus.jsonl", tmp_path / "bm25"
    make_synthetic_corpus(str(corpus), 60, seed=0)
    build = [sys.executable, "-m", "retrieval_server", "build", "--corpus", str(corpus), "--encoder", "bm25"]
    subprocess.run([*build, "--index-type", "flat", "--out", str(index)], cwd=ROOT, check=True, timeout=300)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve = [sys.executable, "-m", "retrieval_server", "serve", "--index", str(index), "--port", str(port)]
    env = child_env()
    env.pop("RETRIEVER_TOKEN", None)
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen([*serve, "--token", "right-token-123"], cwd=ROOT, env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@pytest.mark.slow
def test_wrong_retriever_token_stops_the_run_naming_the_variable(tmp_path, token_server):
    overrides = [f"retriever.url={token_server}", f"data.toy_world.cache_dir={tmp_path / 'cache'}"]
    overrides.append(f"trainer.run_dir={tmp_path / 'run'}")
    done, took = _main(overrides, env={"RETRIEVER_TOKEN": "wrong-token-456"})
    logger.info("wrong RETRIEVER_TOKEN: exit %d after %.1f s", done.returncode, took)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "rejected RETRIEVER_TOKEN" in done.stderr
    assert "wrong-token-456" not in done.stdout + done.stderr and "right-token-123" not in done.stdout + done.stderr


@pytest.mark.slow
def test_token_stays_out_of_config_and_logs(tmp_path, toy_cache):
    run_dir = tmp_path / "run"
    token, key_token = "tok-e2e-secret-789", "tok-e2e-key-456"  # $RETRIEVER_TOKEN, and retriever.token (it wins)
    start = time.monotonic()
    overrides = ("trainer.total_steps=1", f"retriever.token={key_token}")
    done = run_main("search_r1_ppo", run_dir, toy_cache, *overrides, env={"RETRIEVER_TOKEN": token})
    logger.info("1-step run with RETRIEVER_TOKEN set: %.1f s", time.monotonic() - start)
    assert "forwarding RETRIEVER_TOKEN" in done.stderr
    texts = {"stdout": done.stdout, "stderr": done.stderr}
    for path in glob.glob(f"{run_dir}/**/*", recursive=True):
        if os.path.isfile(path) and path.endswith((".yaml", ".json", ".jsonl", ".log", ".txt")):
            with open(path, errors="replace") as f:
                texts[path] = f.read()
    assert "token: <redacted>" in (run_dir / "config.yaml").read_text()
    assert not [name for name, text in texts.items() if token in text or key_token in text]
