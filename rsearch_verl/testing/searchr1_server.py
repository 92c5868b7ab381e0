"""The Search-R1-like baseline retrieval server, for the throughput benchmark (benchmarks/retrieval_throughput.py) and
the tests that check it answers exactly like the product server (tests/retrieval, tests/search).

It serves like Search-R1's `retrieval_server.py`: /retrieve runs in the framework's thread pool, one encode + search
per request (no coalescing), and the response dict is encoded by FastAPI. Everything else is the product's
(retrieval_server/app.py): the token check, the body parsing and limits, the search and result format, /health and
the error handlers, so the benchmark measures the serving architecture and nothing else. Product code never imports
this module.

    python -m rsearch_verl.testing.searchr1_server --index DIR --port 8001 [--token T] [--max-topk 20] ...
    app = create_baseline_app(ServerConfig(token="t"), retriever)        # in-process (tests)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from retrieval_server.__main__ import add_serve_args, load_warm_retriever, server_config
from retrieval_server.app import (
    BodyLimitMiddleware,
    add_error_handlers,
    check_token,
    health_body,
    parse_retrieve_body,
    search_jobs,
)
from retrieval_server.config import ServerConfig

logger = logging.getLogger(__name__)
MODE = "searchr1"  # what /health reports as "mode"


def create_baseline_app(config: ServerConfig, retriever: Any) -> FastAPI:
    """The baseline app serving `retriever` under `config` (its batching fields are unused)."""
    config = config.validated()
    app = FastAPI(title="Search-R1-like baseline retrieval server", docs_url=None, redoc_url=None)
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return health_body(config, retriever, MODE, None)

    @app.post("/retrieve")
    async def retrieve(request: Request) -> dict:
        check_token(config, request.headers.get("authorization"))
        job = parse_retrieve_body(config, await request.body())
        # Like Search-R1's sync handler: the search runs in the thread pool, for this request alone
        results = await run_in_threadpool(search_jobs, retriever, [job], config.batch_max)
        return {"result": results[0]}

    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    return app


def main(argv: list[str] | None = None) -> int:
    """Load the index as `python -m retrieval_server serve` does (same flags) and serve the baseline app."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="python -m rsearch_verl.testing.searchr1_server", description=__doc__)
    add_serve_args(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # CLI only
    import uvicorn

    config = server_config(args)
    retriever = load_warm_retriever(args)
    logger.info("baseline serving %s (%d docs) on http://%s:%d", args.index, retriever.n_docs, config.host, config.port)
    app = create_baseline_app(config, retriever)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False, workers=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
