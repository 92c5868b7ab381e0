"""Serving configuration of the retrieval server: one validated dataclass, defaults in one place.

`python -m retrieval_server serve` builds a `ServerConfig` from its flags (see `__main__.py`); tests and the
benchmark build one directly and hand it to `retrieval_server.app.create_app(config, retriever)`.

Usage:
    cfg = ServerConfig(port=8000, token="s3cret").validated()
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

INGRESSES = ("auto", "haproxy", "proxy")  # `serve --replicas`: see retrieval_server/replicas.py
TOKEN_ENV = "RETRIEVER_TOKEN"


def process_cpus() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one, e.g. Linux; else all of them)."""
    if hasattr(os, "sched_getaffinity"):  # not on macOS
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP side serves a `Retriever`. Limits answer client abuse with 4xx, never 500."""

    host: str = "127.0.0.1"  # loopback unless told otherwise: Search-R1's server binds 0.0.0.0 with no auth
    port: int = 8000
    token: str | None = None  # bearer token; None = no auth (env RETRIEVER_TOKEN fills it in the CLI)
    # queries per request: Search-R1's GRPO step sends 512 prompts x 5 = 2560 in one request; searched in chunks
    max_queries: int = 4096
    max_query_chars: int = 4096  # characters per query (a 100 kB query is refused, not encoded)
    max_topk: int = 100
    max_body_bytes: int = 8 << 20  # 8 MiB; checked on Content-Length and on the bytes actually received
    default_topk: int = 3  # Search-R1's default when the client sends no topk
    batch_max: int = 64  # queries per coalesced search; a larger request is searched in chunks of this many
    batch_wait_ms: float = 0.0  # extra collection window when the search thread is idle (0 = dispatch at once)
    workers: int = 1  # batches searched at once, each on its own thread (the CLI picks 2 on CPU)
    log_level: str = "warning"
    cpus: int = 0  # cores this server may use (0 = the process's CPU affinity; a Ray Serve replica: its num_cpus)
    # POST /documents: whitespace words per page of a document, and ids per request
    page_tokens: int = 512
    max_document_ids: int = 64

    def validated(self) -> ServerConfig:
        """Return self after checking every field; raise ValueError naming the bad field."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        positive = ("max_queries", "max_query_chars", "max_topk", "max_body_bytes", "default_topk", "batch_max")
        positive += ("page_tokens", "max_document_ids")
        if self.cpus < 0:
            raise ValueError(f"cpus must be >= 0, got {self.cpus}")
        for name in (*positive, "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.default_topk > self.max_topk:
            raise ValueError(f"default_topk ({self.default_topk}) must be <= max_topk ({self.max_topk})")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {self.batch_wait_ms}")
        if self.token is not None and not self.token.strip():
            raise ValueError("token must be a non-empty string when given")
        return self

    def own_cpus(self) -> int:
        """The cores this server sizes its threads to: `cpus`, else the ones this process may run on (not
        `os.cpu_count()`, which counts the whole machine: a container or a Ray replica gets fewer)."""
        return self.cpus or process_cpus()

    def with_env_token(self) -> ServerConfig:
        """Fill `token` from $RETRIEVER_TOKEN when no token was given explicitly."""
        if self.token is None and os.environ.get(TOKEN_ENV):
            return dataclasses.replace(self, token=os.environ[TOKEN_ENV])
        return self
