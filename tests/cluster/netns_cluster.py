"""A multi-host Ray cluster on one machine, for tests: each worker host is a network namespace (its own loopback and
address, reached over a veth pair on a bridge) and a mount namespace with tmpfs over ~/.cache, /tmp and /dev/shm
(its own disk); the Ray head runs in the host namespace on the bridge address with 0 CPUs, so every task and actor
lands on a worker host while the job's driver (the head's job supervisor) runs on the head. All hosts see /work and
/var/tmp, where the shared run directory lives. Addresses are in 198.18.0.0/15 (the benchmarking range): traffic
never leaves the machine.

Needs root with CAP_NET_ADMIN (`ip netns add`); `NetnsCluster.start` raises `ClusterError` saying so otherwise.
Everything it makes -- namespaces, links, the bridge, Ray processes, the mounts (they die with their namespace's last
process), the shared directory -- is removed by `stop()`, which is idempotent and safe after a half-done start.

Usage (the `netns_cluster` fixture in tests/cluster/conftest.py does this):
    cluster = NetnsCluster(n_hosts=2).start()
    try:
        done = cluster.submit(["+recipe=search_r1_ppo", ...])        # launch/submit.sh against the head
        cluster.host_run(0, "ls ~/.cache")                            # a command on worker host 0
    finally:
        cluster.stop()
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import httpx
import psutil

logger = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.join(ROOT, ".venv", "bin")
SHARED_ROOT = "/var/tmp"  # outside every host's tmpfs overlays (/tmp, ~/.cache), so all hosts see it
PRIVATE_DIRS = (os.path.expanduser("~/.cache"), "/tmp", "/dev/shm")
OBJECT_STORE_BYTES = 200 << 20


class ClusterError(RuntimeError):
    """The test cluster could not be made (no CAP_NET_ADMIN, a host that did not join, ...)."""


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        return sock.getsockname()[1]


def _free_subnet(pid: int) -> str:
    """A /24 of 198.18.0.0/15 that no interface here uses yet ("198.18.N"); chosen from the pid, so parallel
    clusters of different processes differ."""
    used = _sh("ip", "-o", "-4", "addr").stdout
    for k in range(510):
        n = (pid + k) % 510 + 1
        prefix = f"198.{18 + n // 256}.{n % 256}"
        if f" {prefix}." not in used:
            return prefix
    raise ClusterError("no free /24 left in 198.18.0.0/15")


def ray_env(extra: dict | None = None) -> dict[str, str]:
    """The environment of every Ray process the cluster starts (and of `ray job submit`)."""
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "RAY_USAGE_STATS_ENABLED": "0",
        # a stray ~/.ray/auth_token (token auth is on by default for new clusters) breaks the hosts' connections
        "RAY_AUTH_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("RAY_ADDRESS", None)
    return {**env, **(extra or {})}


class NetnsCluster:
    def __init__(self, n_hosts: int = 2, cpus_per_host: int = 1):
        self.n_hosts, self.cpus_per_host = n_hosts, cpus_per_host
        self.tag = f"rsv{os.getpid()}"  # link and namespace names (interface names are at most 15 bytes)
        self.bridge = f"{self.tag}br"
        self.namespaces: list[str] = []
        self.links: list[str] = []
        self.procs: dict[str, subprocess.Popen] = {}  # "head", "host0", ...: `ray start --block` of each node
        self.prefix = ""
        self.head_temp = ""
        self.shared = ""  # the run directory's parent, seen by every host
        self.driver_dir = ""  # on the head's (the driver's) private disk: /tmp of the machine, not of the hosts
        self.gcs_port = self.dashboard_port = 0

    # ------------------------------------------------------------------------------------------------ addresses

    @property
    def head_ip(self) -> str:
        return f"{self.prefix}.1"

    def host_ip(self, i: int) -> str:
        return f"{self.prefix}.{10 + i}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.head_ip}:{self.dashboard_port}"

    # ------------------------------------------------------------------------------------------------ start

    def start(self, timeout_s: float = 120) -> NetnsCluster:
        if os.geteuid() != 0:
            raise ClusterError("the multi-host test cluster needs root with CAP_NET_ADMIN (ip netns add); run as root")
        try:
            self._network()
            self.shared = tempfile.mkdtemp(prefix=f"{self.tag}_", dir=SHARED_ROOT)
            os.chmod(self.shared, 0o755)
            self.driver_dir = tempfile.mkdtemp(prefix=f"{self.tag}_driver_", dir="/tmp")
            self._start_head(timeout_s)
            for i in range(self.n_hosts):
                self._start_host(i)
            self.wait_nodes(self.n_hosts + 1, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        probe = _sh("ip", "netns", "add", f"{self.tag}probe", check=False)
        if probe.returncode != 0:
            raise ClusterError(
                f"the multi-host test cluster needs root with CAP_NET_ADMIN: `ip netns add` failed "
                f"({probe.stderr.strip()})"
            )
        _sh("ip", "netns", "del", f"{self.tag}probe")
        self.prefix = _free_subnet(os.getpid())
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.links.append(self.bridge)
        _sh("ip", "addr", "add", f"{self.head_ip}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for i in range(self.n_hosts):
            ns, outer, inner = f"{self.tag}h{i}", f"{self.tag}v{i}", f"{self.tag}p{i}"
            _sh("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            self.links.append(outer)
            _sh("ip", "link", "set", outer, "master", self.bridge, "up")
            _sh("ip", "link", "set", inner, "netns", ns)
            for cmd in (
                ["link", "set", "lo", "up"],
                ["addr", "add", f"{self.host_ip(i)}/24", "dev", inner],
                ["link", "set", inner, "up"],
                ["route", "add", "default", "via", self.head_ip],
            ):
                _sh("ip", "-n", ns, *cmd)

    def _start_head(self, timeout_s: float) -> None:
        # the head shares the machine's port space with other Ray instances (the test suite's): every port is free
        self.gcs_port, self.dashboard_port = _free_port(), _free_port()
        self.head_temp = tempfile.mkdtemp(prefix=f"{self.tag}_head_", dir="/tmp")  # short: unix socket path limit
        cmd = ["ray", "start", "--head", "--block", f"--node-ip-address={self.head_ip}", f"--port={self.gcs_port}"]
        cmd += ["--num-cpus=0", "--include-dashboard=true", f"--dashboard-host={self.head_ip}"]
        cmd += [f"--dashboard-port={self.dashboard_port}", f"--temp-dir={self.head_temp}"]
        cmd += [f"--object-store-memory={OBJECT_STORE_BYTES}"]
        for flag in (
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "ray-client-server-port",
            "node-manager-port",
            "object-manager-port",
            "runtime-env-agent-port",
            "metrics-export-port",
        ):
            cmd.append(f"--{flag}={_free_port()}")
        log = open(os.path.join(self.head_temp, "head.out"), "wb")  # noqa: SIM115 -- an unread pipe could stall it
        self.procs["head"] = subprocess.Popen(cmd, env=ray_env(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.dashboard}/api/version", timeout=2).status_code == 200:
                    return
            if self.procs["head"].poll() is not None:
                break
            time.sleep(1)
        with open(os.path.join(self.head_temp, "head.out"), errors="replace") as f:
            raise ClusterError(f"the ray head did not start:\n{f.read()[-3000:]}")

    def _start_host(self, i: int) -> None:
        """`ray start --block` in host i's namespaces: tmpfs mounted over the private dirs first (a fresh mount
        namespace; the mounts disappear with its last process)."""
        mounts = " && ".join(f"mkdir -p {d} && mount -t tmpfs tmpfs {d}" for d in PRIVATE_DIRS)
        start = f"ray start --block --address={self.head_ip}:{self.gcs_port} --node-ip-address={self.host_ip(i)}"
        start += f" --num-cpus={self.cpus_per_host} --object-store-memory={OBJECT_STORE_BYTES} --temp-dir=/tmp/ray"
        script = f"{mounts} && exec {start} > /tmp/host.out 2>&1"
        cmd = ["ip", "netns", "exec", self.namespaces[i], "unshare", "-m", "--propagation", "private"]
        # ip netns exec and unshare exec in place: the Popen's pid is the node's `ray start` (nsenter's target)
        self.procs[f"host{i}"] = subprocess.Popen([*cmd, "sh", "-c", script], env=ray_env())

    # ------------------------------------------------------------------------------------------------ use

    def alive_nodes(self) -> list[dict]:
        """The alive nodes as the head's state API lists them (node_ip, resources_total, ...)."""
        resp = httpx.get(f"{self.dashboard}/api/v0/nodes", params={"limit": 100}, timeout=10)
        resp.raise_for_status()
        rows = resp.json()["data"]["result"]["result"]
        return [r for r in rows if r["state"] == "ALIVE"]

    def wait_nodes(self, n: int, timeout_s: float = 120) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        nodes: list[dict] = []
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, KeyError):
                nodes = self.alive_nodes()
                if len(nodes) == n:
                    return nodes
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise ClusterError(f"ray node {name} exited with {proc.returncode} while starting")
            time.sleep(1)
        raise ClusterError(f"{len(nodes)} alive node(s) after {timeout_s:.0f} s, wanted {n}")

    def host_run(self, i: int, script: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`sh -c script` on worker host i (its network and mount namespaces)."""
        pid = str(self.procs[f"host{i}"].pid)
        cmd = ["nsenter", "-t", pid, "-m", "-n", "sh", "-c", script]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ray_env())

    def submit(self, overrides: list[str], timeout: float = 600, env: dict | None = None):
        """launch/submit.sh with these overrides against the head; retried while the head's job agent has not
        registered yet ("No available agent")."""
        extra = {"RAY_ADDRESS": self.dashboard, "PYTHON": os.path.join(VENV_BIN, "python")}
        extra["RAY"] = os.path.join(VENV_BIN, "ray")
        cmd = ["bash", os.path.join(ROOT, "launch", "submit.sh"), *overrides]
        deadline = time.monotonic() + timeout
        while True:
            left = max(1.0, deadline - time.monotonic())
            done = subprocess.run(cmd, cwd=ROOT, env=ray_env({**extra, **(env or {})}), capture_output=True,
                                  text=True, timeout=left)  # fmt: skip
            if "No available agent" not in done.stdout + done.stderr or time.monotonic() > deadline - 30:
                return done
            time.sleep(2)

    def submit_script(self, script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """`ray job submit` of a Python script of this checkout (the same runtime env as launch/submit.sh)."""
        cmd = [os.path.join(VENV_BIN, "ray"), "job", "submit", "--address", self.dashboard, "--working-dir", "."]
        cmd += ["--runtime-env", "launch/runtime_env.yaml", "--", os.path.join(VENV_BIN, "python"), script, *args]
        deadline = time.monotonic() + timeout
        while True:
            done = subprocess.run(cmd, cwd=ROOT, env=ray_env(), capture_output=True, text=True, timeout=timeout)
            if "No available agent" not in done.stdout + done.stderr or time.monotonic() > deadline - 30:
                return done
            time.sleep(2)

    def stop_host(self, i: int) -> None:
        """Stop worker host i's Ray node (its namespace stays; its mounts go with its processes)."""
        self._stop_proc(f"host{i}")

    def _stop_proc(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        if proc.poll() is None:
            below: list[psutil.Process] = []
            with contextlib.suppress(psutil.NoSuchProcess):
                below = psutil.Process(proc.pid).children(recursive=True)
            proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its node's processes on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            # but not always all: the head's dashboard and runtime-env agents were seen outliving it (orphaned)
            _, alive = psutil.wait_procs(below, timeout=5)
            for leftover in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    leftover.kill()

    # ------------------------------------------------------------------------------------------------ stop

    def stop(self) -> None:
        """Remove everything start() made; safe to call twice and after a failed start."""
        for name in [n for n in self.procs if n != "head"] + ["head"]:
            self._stop_proc(name)
        for ns in self.namespaces:
            self._kill_namespace(ns)
            _sh("ip", "netns", "del", ns, check=False)
        self.namespaces = []
        for link in reversed(self.links):
            _sh("ip", "link", "del", link, check=False)  # a veth's peer goes with it
        self.links = []
        for path in (self.head_temp, self.shared, self.driver_dir):
            if path:
                shutil.rmtree(path, ignore_errors=True)
        self.head_temp = self.shared = self.driver_dir = ""

    @staticmethod
    def _kill_namespace(ns: str) -> None:
        """Kill what a stopped node left in `ns` (workers Ray had not reaped), by pid, so the namespace can go."""
        pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)


def job_logs(cluster: NetnsCluster, done: subprocess.CompletedProcess) -> str:
    """The tail of a submission's output, for assertion messages."""
    return (done.stdout + done.stderr)[-6000:]


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
