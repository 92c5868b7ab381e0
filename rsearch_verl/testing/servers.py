"""A real uvicorn server in a thread for tests: a fake retriever or web API, served on a free 127.0.0.1 port.

srv, thread, url = serve_in_thread(app)
...
srv.should_exit = True; thread.join()
"""

from __future__ import annotations

import threading
import time

import uvicorn

from rsearch_verl.search.service import free_port


def serve_in_thread(app, start_timeout_s: float = 20.0) -> tuple[uvicorn.Server, threading.Thread, str]:
    """Start `app` (any ASGI app) on a free loopback port; return once uvicorn says it has started."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    if not srv.started:
        raise RuntimeError(f"test server did not start within {start_timeout_s} s")
    return srv, thread, f"http://127.0.0.1:{port}"
