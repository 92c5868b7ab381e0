"""The recipe's own retrieval server: build the index if needed, start `python -m retrieval_server serve` as a
separate process on a free port, wait until `/health` answers, stop it at the end. `restart()` starts it again on the
same port (the rollout workers keep its URL); rsearch_verl/search/supervisor.py decides when.

Where it listens: on a cluster (`RAY_ADDRESS` set, as inside `ray job submit`) the driver's own address toward the
Ray head -- the address every host of the cluster reaches this one at -- never the loopback, which on another host is
that host's own; with a local Ray (the cluster is this machine) on 127.0.0.1. Off the loopback it requires a bearer
token: `$RETRIEVER_TOKEN` when the driver has one, else a generated one, put into the driver's environment (the
server and the search clients read it there) and forwarded to the worker actors by rsearch_verl/workers/placement.py
-- never written to config.yaml or a log. On the loopback it uses `$RETRIEVER_TOKEN` if set, as before.

When `retriever.url` is set the driver uses that external server instead (checked with a bounded health probe: a
clear error before any step when it does not answer) and starts nothing.
With `retriever.replay` and `retriever.replay_miss=error` (every search answered from the replay store) it starts and
reaches nothing and yields None (`needed` is False); the session then runs without a supervisor.

Usage:
    with RetrieverService(cfg.retriever, corpus_path, index_dir) as url:
        run_cfg = RunContext(retriever_url=url).apply(cfg)   # rsearch_verl/run_context.py: the config is frozen
        ...
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

import httpx

from rsearch_verl.config import RetrieverConfig

logger = logging.getLogger(__name__)


class RetrieverError(RuntimeError):
    """The retrieval server could not be built, started or reached."""


TOKEN_ENV = "RETRIEVER_TOKEN"  # what the server and the search clients (search/sources/local.py) read
LOOPBACK = ("127.0.0.1", "localhost", "::1")
PROGRESS_EVERY_S = 10.0  # a wait this long gets a log line (an index load can take minutes)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serving_host(ray_address: str | None) -> str:
    """The address to serve on: the local end of a route to the Ray head of `ray_address` (what RAY_ADDRESS holds:
    host:port, a ray:// or http:// URL, or "auto"), so every host of the cluster can reach it; 127.0.0.1 without a
    cluster address (a local Ray: the cluster is this machine)."""
    if not ray_address or ray_address == "local":
        return "127.0.0.1"
    if ray_address == "auto":
        # heavy: ray (seconds to import) only when a cluster is used
        import ray

        return ray.util.get_node_ip_address()

    head = urlparse(ray_address if "://" in ray_address else f"//{ray_address}").hostname
    if not head or head in LOOPBACK:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # UDP connect: picks the route, sends nothing
        sock.connect((head, 9))
        return sock.getsockname()[0]


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> dict:
    """Poll GET /health until it answers 200 (each probe has its own short timeout); every PROGRESS_EVERY_S say
    what it waits for and the key that bounds the wait."""
    start = time.monotonic()
    deadline, said = start + timeout_s, start
    last_error = "no answer"
    while time.monotonic() < deadline:
        if time.monotonic() - said >= PROGRESS_EVERY_S:
            said = time.monotonic()
            logger.info(
                "waiting for the retrieval server at %s to answer GET /health: %.0f s of retriever.start_timeout_s=%g"
                " (%s)",
                url,
                said - start,
                timeout_s,
                last_error,
            )
        if proc is not None and proc.poll() is not None:
            raise RetrieverError(f"retrieval server exited with code {proc.returncode} before becoming healthy")
        try:
            resp = httpx.get(f"{url}/health", timeout=2.0)
            if resp.status_code == 200:
                return resp.json()
            last_error = f"HTTP {resp.status_code}"
        except httpx.HTTPError as exc:
            last_error = repr(exc)
        time.sleep(0.25)
    raise RetrieverError(f"retrieval server at {url} not healthy after {timeout_s:.0f} s ({last_error})")


def ensure_index(cfg: RetrieverConfig, corpus: str, index_dir: str) -> str:
    """Build the index for `corpus` into `index_dir` unless a finished one is already there."""
    if os.path.isfile(os.path.join(index_dir, "manifest.json")):
        return index_dir
    logger.info("building %s/%s index of %s into %s", cfg.encoder, cfg.index_type, corpus, index_dir)
    cmd = [sys.executable, "-m", "retrieval_server", "build", "--corpus", corpus, "--encoder", cfg.encoder]
    cmd += ["--index-type", cfg.index_type, "--out", index_dir]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RetrieverError(f"index build failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    return index_dir


class RetrieverService:
    def __init__(self, cfg: RetrieverConfig, corpus: str | None, index_dir: str | None, log_path: str | None = None):
        self.cfg, self.corpus, self.index_dir, self.log_path = cfg, corpus, index_dir, log_path
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self._log_file = None
        self._env_before: str | None = None
        # replay-only (retriever.replay, replay_miss=error): every search is answered from the store, so there is
        # nothing to start, reach or watch; __enter__ returns None and the run's retriever.url stays as configured
        self.needed = not cfg.replay_only
        # decided now: once the own server is up, the session derives the run's config with its URL (RunContext)
        self.owned = not cfg.url and self.needed  # True: this service starts the server (and may restart it)
        if cfg.replicas and cfg.url:
            logger.warning("retriever.replicas=%d is ignored: retriever.url points at an external server", cfg.replicas)

    def __enter__(self) -> str | None:
        if not self.needed:
            logger.info("replaying searches from retriever.replay=%s: no retrieval server is started or reached",
                        self.cfg.replay)  # fmt: skip
            return None
        if not self.owned:
            self.url = self.cfg.url.rstrip("/")
            try:
                info = wait_healthy(self.url, self.cfg.start_timeout_s)
            except RetrieverError as exc:
                raise RetrieverError(
                    f"retriever.url={self.cfg.url} does not answer GET /health ({exc}). Start the retrieval server "
                    "(python -m retrieval_server serve --index DIR --port PORT, see docs/retriever.md) or unset "
                    "retriever.url to let the recipe start its own."
                ) from exc
            logger.info("using external retrieval server %s (%s)", self.url, info)
            return self.url
        if not (self.corpus and self.index_dir):
            raise RetrieverError("retriever.url is unset and there is no corpus to serve: set retriever.url")
        ensure_index(self.cfg, self.corpus, self.index_dir)
        host = serving_host(os.environ.get("RAY_ADDRESS"))
        self.url = f"http://{host}:{free_port(host)}"
        # reachable from other hosts: a token (the clients of this process read it from the environment; placement
        # forwards it to the worker actors); close() puts back what was there (a test process runs many services)
        self._env_before = os.environ.get(TOKEN_ENV)
        if self.cfg.token or host not in LOOPBACK:  # retriever.token first, else the variable, else a new one
            os.environ[TOKEN_ENV] = self.cfg.token or self._env_before or secrets.token_urlsafe(32)
        self._log_file = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            info = self._spawn()
        except BaseException:
            self.close()
            raise
        logger.info("retrieval server up at %s: %s", self.url, info)
        return self.url

    def _spawn(self) -> dict:
        host, port = self.url.split("://", 1)[1].rsplit(":", 1)
        if self.cfg.replicas and host not in LOOPBACK:
            host = "0.0.0.0"  # Serve runs a proxy on every node, each bound here (the token guards them all)
        cmd = [sys.executable, "-m", "retrieval_server", "serve", "--index", self.index_dir]
        cmd += ["--host", host, "--port", port]
        if self.cfg.replicas:  # Ray Serve: the replicas join the run's cluster ($RAY_ADDRESS) or a local Ray of its own
            cmd += ["--replicas", str(self.cfg.replicas), "--replica-cpus", str(self.cfg.replica_cpus)]
        # the token (if any) goes through the environment the server inherits: argv is world-readable
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT)
        return wait_healthy(self.url, self.cfg.start_timeout_s, self.proc)

    def alive(self) -> bool:
        """The own server's process still runs (always True for an external server: nothing to watch)."""
        return not self.owned or (self.proc is not None and self.proc.poll() is None)

    def restart(self) -> dict:
        """Stop the own server if it still runs (e.g. hung) and start it again on the same port; raises
        RetrieverError when it does not come up. The index is built already, so this takes seconds."""
        if not self.owned or self.url is None:
            raise RetrieverError("only the server this run started can be restarted")
        self._stop_process()
        return self._spawn()

    def _stop_process(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:  # replicas on a local Ray: its shutdown (~10 s), then the server stops its HAProxy (Ray would not)
                self.proc.wait(timeout=30 if self.cfg.replicas else 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self._stop_process()
        if self.owned and self.url is not None and self._env_before is None:
            os.environ.pop(TOKEN_ENV, None)
        if self._log_file not in (None, subprocess.DEVNULL):
            self._log_file.close()
        self._log_file = None

    def __exit__(self, *exc) -> None:
        self.close()
