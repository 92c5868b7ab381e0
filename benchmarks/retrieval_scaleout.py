"""Retrieval scale-out on Ray Serve: QPS, p50 and p99 of the single server, Serve with 1 replica and Serve with 2
replicas on two hosts, for MiniLM (encoder-bound) and BM25.

The hosts are the multi-host test harness (tests/cluster/netns_cluster.py): two network + mount namespaces, each a
Ray node of --cpus-per-host CPUs (default 1), with a 0-CPU Ray head on the bridge in the machine's own namespace.
Every process of host i is pinned to its own cores (`--pin`, on whenever the machine has enough cores), so "each host
its own CPUs" is true of the cores, not only of Ray's bookkeeping; the load generator, the head and the Serve driver
get the cores left over (none on a 2-core machine: they then share the hosts' cores). The index (synthetic corpus;
MiniLM flat or BM25) lives under /var/tmp, which every host sees; it is built once and cached there.

Configurations, each driven by the same closed-loop load generator in its OWN process (every simulated client holds
one keep-alive connection, one query per request, back to back; the first --warmup-s are not counted):

* `single`     `python -m retrieval_server serve` (one uvicorn process, no Ray) on host 0's cores;
* `serve-1r`   `serve --replicas 1 --replica-cpus K --ingress I` with RAY_ADDRESS=<head>: one replica; the load
               goes to the ingress of the host that holds it (one host's cores run the ingress and the replica);
* `serve-2r`   `serve --replicas 2`: one replica per host; the load generator spreads its connections over both
               hosts' ingresses (each balances over both replicas), so each added host brings its own ingress.

The ingress (`--ingress`, default auto = HAProxy on Linux; `proxy` = Serve's Python proxy) is fixed when Serve first
starts on the harness's cluster, so one run measures one ingress.

Prints a table (config, encoder, QPS, p50 ms, p99 ms, errors, p99/p50, and the hosts' CPU milliseconds per request
by role -- the server or replicas, the ingress, the rest of the node -- which says where a core's time goes), the
issue's targets beside the measured values (2 replicas on 2 hosts >= 1.8x the QPS of 1 replica with MiniLM; Serve
with 1 replica within 10 % of the single server; p99 <= 2x p50), and last the line
`2-replica / 1-replica QPS ratio (minilm): X.XX`.

    .venv/bin/python benchmarks/retrieval_scaleout.py                         # 20k docs, 20 s per config
    .venv/bin/python benchmarks/retrieval_scaleout.py --docs 2000 --duration-s 5 --warmup-s 2   # a smoke run (~3 min)
    .venv/bin/python benchmarks/retrieval_scaleout.py --cpus-per-host 4      # bigger hosts, on a >= 8-core machine
    .venv/bin/python benchmarks/retrieval_scaleout.py --ingress proxy        # through Serve's Python proxy

Time: the MiniLM index build dominates the first run (it encodes the corpus: 18 passages/s on 2 busy cores); it is
cached. Then ~30 s for the cluster and, per configuration, 10-25 s to start plus warm-up + duration (~5 min in all
with the defaults).

Needs root with CAP_NET_ADMIN (the harness makes namespaces); everything it makes -- servers, Ray nodes, namespaces,
links -- is removed when it ends, also on failure, Ctrl-C or SIGTERM. The index cache (--work-dir) is kept.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))  # the multi-host harness
sys.path.insert(0, str(REPO / "benchmarks"))

from netns_cluster import SHARED_ROOT, NetnsCluster, ray_env  # noqa: E402
from retrieval_throughput import _client, _env, _free_port, _get_json, _request_bytes, prepare_index  # noqa: E402

from retrieval_server.config import INGRESSES  # noqa: E402
from retrieval_server.replicas import haproxy_pids  # noqa: E402

logger = logging.getLogger("retrieval_scaleout")
CONFIGS = ("single", "serve-1r", "serve-2r")
START_TIMEOUT_S = 300.0


# ----------------------------------------------------------------------------------------------------------------
# Load generator (its own process: `--loadgen URL[,URL...]`)
# ----------------------------------------------------------------------------------------------------------------


async def _resilient(host: str, port: int, requests: list[bytes], offset: int, stop_at: float, out: list, broken: list):
    """retrieval_throughput's client, reconnecting as an HTTP client does when its keep-alive connection is closed
    under it (HAProxy closes idle ones when it reloads its configuration): each break counts one error."""
    while time.perf_counter() < stop_at:
        try:
            await _client(host, port, requests, offset, stop_at, out)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            broken.append(repr(exc))
            await asyncio.sleep(0.05)


async def _load(urls: list[str], concurrency: int, duration: float, warmup: float, queries: list[str], topk: int):
    """Closed loop over several entry points: client c talks to urls[c % len(urls)] (retrieval_throughput's client)."""
    addrs = [(u.removeprefix("http://").rsplit(":", 1)[0], int(u.rsplit(":", 1)[1])) for u in urls]
    bodies = [json.dumps({"queries": [q], "topk": topk, "return_scores": True}).encode() for q in queries]
    requests = {a: [_request_bytes(a[0], a[1], b) for b in bodies] for a in addrs}
    measure_from = time.perf_counter() + warmup
    stop_at = measure_from + duration
    out: list = []
    broken: list = []
    step = max(1, len(bodies) // concurrency)
    clients = []
    for c in range(concurrency):
        host, port = addrs[c % len(addrs)]
        clients.append(_resilient(host, port, requests[(host, port)], c * step, stop_at, out, broken))
    await asyncio.gather(*clients)
    window = [(lat, ok) for t, lat, ok in out if measure_from <= t <= stop_at]
    lats = sorted(lat for lat, _ in window)
    result = {"n": len(window), "errors": sum(not ok for _, ok in window) + len(broken), "broken": broken[:3]}
    if not lats:
        return {**result, "qps": 0.0, "p50_ms": float("nan"), "p99_ms": float("nan")}
    return {
        **result,
        "qps": len(window) / duration,
        "p50_ms": 1000 * lats[len(lats) // 2],
        "p99_ms": 1000 * lats[min(len(lats) - 1, int(0.99 * len(lats)))],
    }


def loadgen_main(args: argparse.Namespace) -> None:
    if args.loadgen_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.loadgen_cpus.split(",")})
    queries = json.loads(Path(args.queries_file).read_text())
    urls = args.loadgen.split(",")
    result = asyncio.run(_load(urls, args.concurrency, args.duration_s, args.warmup_s, queries, args.topk))
    print(json.dumps(result))  # noqa: T201  (read by the parent process)


def run_load(urls: list[str], args: argparse.Namespace, queries_file: Path, loadgen_cpus: set[int]) -> dict:
    cmd = [sys.executable, __file__, "--loadgen", ",".join(urls), "--concurrency", str(args.concurrency)]
    cmd += ["--duration-s", str(args.duration_s), "--warmup-s", str(args.warmup_s), "--topk", str(args.topk)]
    cmd += ["--queries-file", str(queries_file)]
    if loadgen_cpus:
        cmd += ["--loadgen-cpus", ",".join(map(str, sorted(loadgen_cpus)))]
    timeout = args.duration_s + args.warmup_s + 120
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------------------
# Processes on the hosts
# ----------------------------------------------------------------------------------------------------------------


def namespace_cpu_s(namespaces: list[str]) -> dict[str, float]:
    """CPU seconds used so far by the hosts' processes, by role: `server` (the single server or a replica), `proxy`
    (Serve's ingress: its Python proxy, or HAProxy and the actor that manages it) and `other` (raylet, idle workers,
    ...). Taken before and after a load run."""
    import psutil

    out = {"server": 0.0, "proxy": 0.0, "other": 0.0}
    for ns in namespaces:
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(int(pid))
                argv = proc.cmdline()
                title = " ".join(argv)
                ingress = "ProxyActor" in title or "HAProxyManager" in title or Path(argv[0]).name == "haproxy"
                role = "proxy" if ingress else "other"
                if "ServeReplica" in title or "retrieval_server serve" in title:
                    role = "server"
                times = proc.cpu_times()
                out[role] += times.user + times.system
    return out


def pin_namespace(ns: str, cpus: set[int]) -> int:
    """Pin every thread of every process in network namespace `ns` to `cpus` (children inherit it); returns the
    number of processes pinned. Run again after Ray started new workers there, to catch ones forked meanwhile."""
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cpus)
    return len(pids)


def namespace_of(pid: int) -> str:
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def shielded():
    """SIGTERM / SIGINT held back while a clean-up runs (a signal must not leave half of it undone), then acted on."""
    held: list[int] = []
    old = {sig: signal.signal(sig, lambda s, _: held.append(s)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if held:
            raise SystemExit(128 + held[0])


def spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with log.open("w") as fh:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def terminate(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM the process group (the Serve driver deletes its application on it), SIGKILL if it lingers."""
    with shielded():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_replicas(urls: list[str], n: int, proc: subprocess.Popen, log: Path) -> set[int]:
    """Poll /health through `urls` until `n` distinct processes answered; returns their pids."""
    seen: set[int] = set()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")
        for url in urls:
            pid = (_get_json(f"{url}/health") or {}).get("pid")
            if pid:
                seen.add(pid)
        if len(seen) >= n:
            return seen
        time.sleep(0.5 if seen else 2)
    raise TimeoutError(f"{len(seen)} of {n} server process(es) healthy after {START_TIMEOUT_S:.0f} s; see {log}")


class Bench:
    """One cluster, the configurations run one after another on it."""

    def __init__(self, args: argparse.Namespace, cluster: NetnsCluster, host_cpus: list[set[int]]):
        self.args, self.cluster, self.host_cpus = args, cluster, host_cpus
        self.logs = Path(cluster.shared)
        self.serve_port = _free_port()  # Serve's HTTP options are fixed once it started: one port for every run
        used = set().union(*host_cpus) if host_cpus else set()
        self.loadgen_cpus = set(os.sched_getaffinity(0)) - used

    def pin(self) -> None:
        for i, cpus in enumerate(self.host_cpus):
            pin_namespace(self.cluster.namespaces[i], cpus)

    def load(self, urls: list[str], queries_file: Path) -> dict:
        """One closed-loop run, plus the hosts' CPU per request by role (over warm-up and measurement together)."""
        before = namespace_cpu_s(self.cluster.namespaces)
        res = run_load(urls, self.args, queries_file, self.loadgen_cpus)
        after = namespace_cpu_s(self.cluster.namespaces)
        n_all = res["qps"] * (self.args.duration_s + self.args.warmup_s)  # requests served, warm-up included (approx.)
        for role in before:
            res[f"cpu_ms_{role}"] = 1000 * (after[role] - before[role]) / n_all if n_all else float("nan")
        return res

    def single(self, index: Path, queries_file: Path) -> dict:
        """The plain server in host 0's namespaces, on host 0's core."""
        port = _free_port()
        host = self.cluster.host_ip(0)
        cmd = ["nsenter", "-t", str(self.cluster.procs["host0"].pid), "-m", "-n"]
        if self.host_cpus:
            cmd += ["taskset", "-c", ",".join(map(str, sorted(self.host_cpus[0])))]
        cmd += [sys.executable, "-m", "retrieval_server", "serve", "--index", str(index), "--host", host]
        cmd += ["--port", str(port), "--log-level", "warning"]
        log = self.logs / f"single_{index.name}.log"
        proc = spawn(cmd, log, ray_env(_env()))
        try:
            url = f"http://{host}:{port}"
            wait_replicas([url], 1, proc, log)
            return {"entry": "host0 (uvicorn, no proxy)", **self.load([url], queries_file)}
        finally:
            terminate(proc)

    def replicated(self, index: Path, queries_file: Path, replicas: int) -> dict:
        """`serve --replicas N` deployed on the harness's cluster from the machine's namespace (RAY_ADDRESS)."""
        cmd = [sys.executable, "-m", "retrieval_server", "serve", "--index", str(index), "--replicas", str(replicas)]
        cmd += ["--replica-cpus", str(self.args.cpus_per_host), "--host", "0.0.0.0", "--port", str(self.serve_port)]
        cmd += ["--ingress", self.args.ingress, "--log-level", "warning"]
        env = ray_env({**_env(), "RAY_ADDRESS": f"{self.cluster.head_ip}:{self.cluster.gcs_port}"})
        log = self.logs / f"serve{replicas}_{index.name}.log"
        proc = spawn(cmd, log, env)
        try:
            all_urls = [f"http://{self.cluster.host_ip(i)}:{self.serve_port}" for i in range(self.cluster.n_hosts)]
            pids = wait_replicas(all_urls, replicas, proc, log)  # through any host proxy that is up
            self.pin()  # the replicas and proxies Ray forked since the last pinning
            hosts = sorted({self.cluster.namespaces.index(namespace_of(p)) for p in pids})
            urls = [all_urls[i] for i in hosts]
            cores = {p: sorted(os.sched_getaffinity(p)) for p in pids}
            logger.info("%d replica(s) on host(s) %s, pid: cores %s; load through %s", replicas, hosts, cores, urls)
            entry = "+".join(f"host{i}" for i in hosts) + f" {self.args.ingress}"
            return {"entry": entry, **self.load(urls, queries_file)}
        finally:
            terminate(proc)


def run_all(args: argparse.Namespace) -> list[dict]:
    work = Path(args.work_dir) / f"n{args.docs}"
    indexes = {enc: prepare_index(work, args.docs, enc)[0] for enc in args.encoders}
    queries_file = work / "queries.json"
    n_hosts, k = 2, args.cpus_per_host
    cpus = sorted(os.sched_getaffinity(0))
    pin = args.pin == "on" or (args.pin == "auto" and len(cpus) >= n_hosts * k)
    if pin and len(cpus) < n_hosts * k:
        raise SystemExit(f"--pin on needs {n_hosts * k} cores, this process may use {len(cpus)}")
    first = len(cpus) - n_hosts * k  # the hosts take the last cores, the load generator the ones before
    host_cpus = [set(cpus[first + i * k : first + (i + 1) * k]) for i in range(n_hosts)] if pin else []
    logger.info("hosts pinned to cores %s", host_cpus if pin else "(not pinned)")
    cluster = NetnsCluster(n_hosts=n_hosts, cpus_per_host=k)
    haproxy_before = haproxy_pids()
    rows: list[dict] = []
    try:
        cluster.start()
        bench = Bench(args, cluster, host_cpus)
        bench.pin()
        for enc, index in indexes.items():
            for config in args.configs:
                t0 = time.perf_counter()
                if config == "single":
                    res = bench.single(index, queries_file)
                else:
                    res = bench.replicated(index, queries_file, int(config.removeprefix("serve-").removesuffix("r")))
                rows.append({"config": config, "encoder": enc, **res})
                logger.info("%s %s (%.0f s): %s", config, enc, time.perf_counter() - t0, res)
    finally:
        with shielded():
            cluster.stop()
            for pid in haproxy_pids() - haproxy_before:  # `ray stop` leaves the HAProxy a node's Serve started
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def report(rows: list[dict], encoders: list[str]) -> None:
    head = f"{'config':<9} {'encoder':<7} {'QPS':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6} {'p99/p50':>8}"
    head += f" {'cpu ms/req: server':>18} {'proxy':>6} {'other':>6}  load via"
    print(head)  # noqa: T201
    for r in rows:
        cpu = f"{r['cpu_ms_server']:>18.2f} {r['cpu_ms_proxy']:>6.2f} {r['cpu_ms_other']:>6.2f}"
        tail = f"{_ratio(r['p99_ms'], r['p50_ms']):>8.2f} {cpu}  {r['entry']}"
        print(  # noqa: T201
            f"{r['config']:<9} {r['encoder']:<7} {r['qps']:>8.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
            f"{r['errors']:>6} {tail}"
        )
    by = {(r["config"], r["encoder"]): r for r in rows}
    print("targets (issue: a retrieval tier that scales out on Ray Serve):")  # noqa: T201
    for enc in encoders:
        single, one, two = (by.get((c, enc)) for c in CONFIGS)
        if one and two:
            x = _ratio(two["qps"], one["qps"])
            goal = ">= 1.80 (MiniLM)" if enc == "minilm" else "(no target for BM25)"
            print(f"  {enc}: serve-2r / serve-1r QPS = {x:.2f}  target {goal}")  # noqa: T201
        if single and one:
            x = _ratio(one["qps"], single["qps"])
            print(f"  {enc}: serve-1r / single QPS = {x:.2f}  target >= 0.90")  # noqa: T201
    worst = max(rows, key=lambda r: _ratio(r["p99_ms"], r["p50_ms"]))
    print(  # noqa: T201
        f"  worst p99/p50 = {_ratio(worst['p99_ms'], worst['p50_ms']):.2f} ({worst['config']} {worst['encoder']})"
        "  target <= 2.00"
    )
    enc = "minilm" if "minilm" in encoders else encoders[0]
    one, two = by.get(("serve-1r", enc)), by.get(("serve-2r", enc))
    ratio = _ratio(two["qps"], one["qps"]) if one and two else float("nan")
    print(f"2-replica / 1-replica QPS ratio ({enc}): {ratio:.2f}")  # noqa: T201


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=20000, help="synthetic corpus size")
    p.add_argument("--duration-s", type=float, default=20.0, help="measured seconds per configuration")
    p.add_argument("--warmup-s", type=float, default=5.0, help="unmeasured seconds before each measurement")
    p.add_argument("--concurrency", type=int, default=64, help="closed-loop clients")
    p.add_argument("--encoders", type=lambda s: s.split(","), default=["minilm", "bm25"])
    p.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS), help=",".join(CONFIGS))
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--cpus-per-host", type=int, default=1, help="each host's Ray CPUs = a replica's --replica-cpus")
    p.add_argument("--ingress", choices=INGRESSES, default="auto", help="Serve's ingress (serve --ingress)")
    p.add_argument("--pin", choices=["auto", "on", "off"], default="auto", help="pin each host to its own cores")
    p.add_argument("--work-dir", default=os.path.join(SHARED_ROOT, "rsv_bench_scaleout"), help="index cache")
    p.add_argument("--json-out", default=None, help="also write the rows as JSON here")
    # internal: the load generator process
    p.add_argument("--loadgen", default=None, help=argparse.SUPPRESS)
    p.add_argument("--loadgen-cpus", default="", help=argparse.SUPPRESS)
    p.add_argument("--queries-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.loadgen:
        loadgen_main(args)
        return
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; choose from {CONFIGS}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /health poll otherwise
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through the clean-up, as Ctrl-C does
    rows = run_all(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    report(rows, args.encoders)


if __name__ == "__main__":
    main()
