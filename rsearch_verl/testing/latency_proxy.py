"""A retrieval server with a realistic search latency: a proxy in front of a real one that waits before each search.

Benchmarks use it to give the toy world's millisecond BM25 the latency of a real search backend (a web search API,
a remote Wikipedia index) without changing what is retrieved: every request is forwarded unchanged to the real
server, POSTs after `latency_s` +- `jitter_s` (uniform, seeded). Served by uvicorn in a thread of this process.

    srv, url = serve(latency_proxy("http://127.0.0.1:8000", latency_s=1.0, jitter_s=0.3, seed=0))
    ... point retriever.url at `url` ...
    srv.should_exit = True
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response


def latency_proxy(upstream: str, latency_s: float, jitter_s: float = 0.0, seed: int = 0) -> FastAPI:
    """An app forwarding every GET / POST to `upstream`; each POST (a search) first waits latency +- jitter."""
    app = FastAPI()
    rng = random.Random(seed)
    client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=120.0)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        body = await request.body()
        if request.method == "POST":
            await asyncio.sleep(max(0.0, latency_s + rng.uniform(-jitter_s, jitter_s)))
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        resp = await client.request(request.method, f"/{path}", content=body, headers=headers)
        return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    return app


def serve(app: FastAPI) -> tuple[uvicorn.Server, str]:
    """Run `app` on a free 127.0.0.1 port in a daemon thread; returns the server (set should_exit) and its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not srv.started:
        if time.monotonic() > deadline:
            raise RuntimeError("latency proxy did not start within 30 s")
        time.sleep(0.05)
    return srv, f"http://127.0.0.1:{port}"
