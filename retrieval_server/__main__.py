"""Command line of the retrieval server: `build` an index, `serve` it over HTTP.

    python -m retrieval_server build --corpus C.jsonl --encoder minilm --index-type flat --out DIR [--chunk-tokens N]
    python -m retrieval_server serve --index DIR --host 127.0.0.1 --port 8000 [--token T]
                                     [--batch-max 64] [--batch-wait-ms 0] [--max-topk 100] [--device cpu]
                                     [--page-tokens 512] [--max-document-ids 64]       # POST /documents
                                     [--replicas N [--replica-cpus 1]]   # Ray Serve, see retrieval_server/replicas.py

`serve` binds 127.0.0.1 unless `--host` says otherwise; `--token` (or $RETRIEVER_TOKEN) turns on bearer auth for
/retrieve and /documents. One uvicorn worker: the index is loaded once and the micro-batcher owns the cores;
`--replicas N` serves the same app from N Ray Serve replicas instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from retrieval_server.config import INGRESSES, ServerConfig, process_cpus
from retrieval_server.retriever import load_retriever, read_manifest

logger = logging.getLogger("retrieval_server")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    p.add_argument("--index", required=True, help="index directory written by `build` (holds manifest.json)")
    p.add_argument("--host", default=d.host, help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--token", default=None, help="bearer token required on /retrieve (default: $RETRIEVER_TOKEN)")
    p.add_argument("--device", default="cpu", help="encoder / index device (cuda shards FAISS over all GPUs)")
    p.add_argument("--batch-max", type=int, default=d.batch_max, help="max queries per coalesced search")
    p.add_argument("--batch-wait-ms", type=float, default=d.batch_wait_ms, help="gather window when idle")
    p.add_argument("--max-queries", type=int, default=d.max_queries)
    p.add_argument("--max-query-chars", type=int, default=d.max_query_chars)
    p.add_argument("--max-topk", type=int, default=d.max_topk)
    p.add_argument("--default-topk", type=int, default=d.default_topk)
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    p.add_argument("--page-tokens", type=int, default=d.page_tokens, help="POST /documents: whitespace words per page")
    p.add_argument("--max-document-ids", type=int, default=d.max_document_ids, help="POST /documents: ids per request")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = library default)")
    p.add_argument(
        "--workers", type=int, default=0, help="batches searched at once (0 = auto: 2 on a multi-core CPU, else 1)"
    )
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="serve through Ray Serve with this many replicas on the cluster at $RAY_ADDRESS (unset: a local Ray); "
        "0 = one uvicorn process (default)",
    )
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs each Serve replica asks Ray for")
    p.add_argument(
        "--ingress",
        choices=INGRESSES,
        default="auto",
        help="with --replicas: Serve's HAProxy ingress (auto: where its binary exists, Linux) or its Python proxy",
    )


def search_workers(args: argparse.Namespace) -> int:
    """--workers, or auto: two single-threaded batches at once on a multi-core CPU (less intra-op overhead than
    one batch over all cores, see retrieval_server/batching.py), one batch at a time on a GPU."""
    if args.workers:
        return args.workers
    return 2 if args.device == "cpu" and process_cpus() >= 2 else 1


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The validated ServerConfig of `serve`'s flags (the token from $RETRIEVER_TOKEN when no --token)."""
    # every ServerConfig field the CLI has a flag for, by the flag's name; the thread count is derived
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if hasattr(args, f.name)}
    config = ServerConfig(**(flags | {"workers": search_workers(args)}))
    return config.with_env_token().validated()


def load_warm_retriever(args: argparse.Namespace):
    """The index of `--index` on `--device`, its first-call allocations paid (torch threads per `--threads`)."""
    if args.threads > 0:  # with several workers each batch thread re-sets its own count (app.share_cores)
        import torch  # heavy: torch only where it is used (a BM25 index needs none); after main() set OMP_WAIT_POLICY

        torch.set_num_threads(args.threads)
    retriever = load_retriever(args.index, device=args.device)
    retriever.search(["warm up the encoder and the index"], 1)  # first-call allocations out of the first request
    return retriever


def serve(args: argparse.Namespace) -> None:
    """Load the index, warm it up, and run uvicorn until interrupted."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no-op when main() set it already (see there)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config = server_config(args)
    if args.replicas < 0 or args.replica_cpus <= 0:
        raise ValueError(f"--replicas must be >= 0 and --replica-cpus > 0, got {args.replicas}, {args.replica_cpus}")
    if args.replicas and args.device != "cpu":
        # a replica asks Ray for CPUs only, and Ray hides the GPUs from an actor that asked for none
        raise ValueError(f"--replicas serves on CPU only (got --device {args.device}); one process serves a GPU index")
    _warn_if_open(config)
    if args.replicas:
        # heavy: replicas imports ray (seconds), needed only with --replicas
        from retrieval_server.replicas import ReplicaSpec, run_until_signalled

        read_manifest(args.index)  # a missing index fails here in one line, not as N replica start-up tracebacks

        spec = ReplicaSpec(args.replicas, args.replica_cpus, args.device, args.ingress)
        run_until_signalled(args.index, config, spec)
        return

    # serve only: fastapi / uvicorn stay out of `build` and of --replicas (Ray Serve runs the app there)
    import uvicorn

    from retrieval_server.app import create_app

    retriever = load_warm_retriever(args)
    app = create_app(config, retriever)
    logger.info("serving %s (%d docs) on http://%s:%d", args.index, retriever.n_docs, config.host, config.port)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False, workers=1)


def _warn_if_open(config: ServerConfig) -> None:
    if config.host not in ("127.0.0.1", "localhost", "::1") and config.token is None:
        logger.warning("serving on %s without a token: anyone who can reach the port can query", config.host)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        # Before anything imports torch / faiss (build's arguments may): idle OpenMP threads then sleep instead
        # of spinning a core between batches, which halves CPU use at low load.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = argparse.ArgumentParser(prog="python -m retrieval_server", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build_p = sub.add_parser("build", help="encode a JSONL corpus and write an index directory")
    serve_p = sub.add_parser("serve", help="serve an index over HTTP (POST /retrieve, POST /documents, GET /health)")
    add_serve_args(serve_p)
    # heavy: build imports faiss, which must load after OMP_WAIT_POLICY is set above
    from retrieval_server.build import add_build_args

    add_build_args(build_p)
    args = parser.parse_args(argv)
    # bm25s takes jax for its top-k when jax is installed, and jax grabs 75 % of every visible GPU when it starts
    # (measured on an H100: the embedded BM25 server held 60 GB beside the training workers). Both variables are read
    # when jax starts its backend (first use), so setting them here, before any search, is enough.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if getattr(args, "device", "cpu") == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        try:
            serve(args)
        except (ValueError, FileNotFoundError) as exc:  # bad flags / missing index: one clear line, not a traceback
            logger.error("%s", exc)
            return 2
        return 0
    from retrieval_server.build import run_build  # heavy: faiss (see above)

    out = run_build(args)
    logger.info("index written to %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
