"""Preflight: the cheap checks a run makes before anything expensive (data, the warm start, Ray, worker groups).

A dead `retriever.url`, a run directory that cannot be written or a missing retriever token used to surface only
after minutes of start-up (the toy warm start alone takes ~10 min from an empty cache on a 2-core machine). These
checks take seconds and stop the run with exit code 3 and a message that names the config key or variable to fix
(docs/health.md):

- `trainer.run_dir` can be created and written;
- an external `retriever.url` answers `GET /health` within `retriever.preflight_wait_s` (a few bounded probes,
  each logged);
- when that server requires a bearer token (its /health says `"auth": true`) `RETRIEVER_TOKEN` is set, and a set
  token is accepted (one unauthenticated-body POST /retrieve: the server checks the token before the body, so it
  costs no search);
- `retriever.replay` names a record/replay store, `retriever.record` can be created, and neither is pinned to
  another index than the one at `retriever.url` (rsearch_verl/search/replay.py); a replay-only run
  (`retriever.replay_miss=error`) does not wait for, or need, any retriever;
- a judge endpoint with an `api_key_env` that is not set gets a warning (local judges need no key), and so do the
  web / news tools of a multi-source protocol without `SERPER_API_KEY` (by design those answer error observations).

Once Ray is up and before any worker starts, `check_hosts` makes the same checks from every other host of a
multi-host cluster (a probe task per host): each sees trainer.run_dir, the config's local model paths and the
retrieval server; a loopback retriever.url is an error there (HostError, a PlacementError, naming the key).

    from rsearch_verl.trainer.preflight import check_hosts, preflight
    preflight(cfg, run_dir)    # raises PreflightError (a RunStopped: exit 3) naming what to fix
    check_hosts(cfg)           # after ray.init, before build_worker_groups
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from urllib.parse import urlparse

import httpx
import ray

from rsearch_verl.config import RetrieverConfig, RSearchConfig
from rsearch_verl.search.replay import open_stores
from rsearch_verl.search.sources.local import health_fingerprint
from rsearch_verl.search.store import StoreError, StoreMismatchError, check_fingerprint
from rsearch_verl.trainer.health import RunStopped
from rsearch_verl.workers.pools import PlacementError

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0  # one GET /health; a server that cannot answer that in 5 s is not ready to serve a rollout
PROBE_INTERVAL_S = 4.0
AUTH_STATUSES = (401, 403)


class PreflightError(RunStopped):
    """A start-up check failed; the message names the key or variable to fix."""


def preflight(cfg: RSearchConfig, run_dir: str) -> None:
    """Run every check for `cfg`; raise PreflightError at the first that fails."""
    start = time.monotonic()
    check_run_dir(run_dir)
    info = None
    if cfg.retriever.url and not cfg.retriever.replay_only:  # replay-only runs never reach the retriever
        info = wait_for_retriever(cfg.retriever.url, cfg.retriever.preflight_wait_s)
        check_retriever_token(cfg.retriever.url, info, cfg.retriever.token or os.environ.get("RETRIEVER_TOKEN"))
    if cfg.retriever.record or cfg.retriever.replay:
        check_record_replay(cfg.retriever, info)
    warn_missing_keys(cfg)
    logger.info("preflight passed in %.1f s", time.monotonic() - start)


def warn_missing_keys(cfg: RSearchConfig) -> None:
    """Warnings only: a keyless judge may be a local server, and a web tool without a key is a recipe's choice."""
    judge = cfg.reward.judge
    if judge.url and judge.api_key_env and not os.environ.get(judge.api_key_env):
        logger.warning("reward.judge.url is set but %s is not: the judge is called without a key", judge.api_key_env)
    tools = cfg.rollout.protocol_kwargs.get("tools")  # a multi-source protocol's {tool name: source}
    web = sorted({src for src in tools.values() if src in ("web", "news")}) if isinstance(tools, dict) else []
    if web and not os.environ.get("SERPER_API_KEY"):
        logger.warning("SERPER_API_KEY is not set: the %s search tools answer error observations", "/".join(web))


def check_run_dir(run_dir: str) -> None:
    """`run_dir` exists (made if needed) and a file can be written in it."""
    probe = os.path.join(run_dir, f".preflight-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok\n")
        os.remove(probe)
    except OSError as exc:
        raise PreflightError(
            f"trainer.run_dir={run_dir} is not writable ({exc}); point it at a writable directory"
        ) from exc


def wait_for_retriever(url: str, wait_s: float) -> dict:
    """Probe `GET {url}/health` until it answers 200 or `wait_s` has passed; return its JSON (or {})."""
    url = url.rstrip("/")
    deadline = time.monotonic() + max(0.0, wait_s)
    attempt, last = 0, "no answer"
    while True:
        attempt += 1
        try:
            resp = httpx.get(f"{url}/health", timeout=PROBE_TIMEOUT_S)
            if resp.status_code == 200:
                return _json_or_empty(resp)
            last = f"HTTP {resp.status_code}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        left = deadline - time.monotonic()
        if left <= 0:
            break
        logger.warning(
            "preflight: waiting for retriever.url=%s to answer GET /health (probe %d: %s; %.0f s left of "
            "retriever.preflight_wait_s=%g)",
            url,
            attempt,
            last,
            left,
            wait_s,
        )
        time.sleep(min(PROBE_INTERVAL_S, left))
    raise PreflightError(
        f"retriever.url={url} does not answer GET /health after {attempt} probe(s) over {wait_s:g} s ({last}). "
        "Start the retrieval server (python -m retrieval_server serve --index DIR --port PORT, see docs/retriever.md), "
        "fix retriever.url, or unset it to let the recipe start its own; raise retriever.preflight_wait_s when the "
        "server starts together with the job."
    )


def check_retriever_token(url: str, health: dict, token: str | None) -> None:
    """A server that requires a token gets one, and the one we have is accepted (HTTP 401 / 403 otherwise)."""
    if health.get("auth") and not token:
        raise PreflightError(
            f"retriever.url={url} requires a bearer token (its /health says auth) but RETRIEVER_TOKEN is not set: "
            "export RETRIEVER_TOKEN with the server's --token where the run is started"
        )
    if not token:
        return
    # a body the server rejects (4xx) only after checking the token: no search runs, no encoder batch is paid
    headers = {"Authorization": f"Bearer {token}"}
    try:
        resp = httpx.post(f"{url.rstrip('/')}/retrieve", json={"preflight": True}, headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        logger.warning("preflight: could not check RETRIEVER_TOKEN against %s (%s)", url, exc)
        return
    if resp.status_code in AUTH_STATUSES:
        raise PreflightError(
            f"retriever.url={url} rejected RETRIEVER_TOKEN (HTTP {resp.status_code}): export the server's --token as "
            "RETRIEVER_TOKEN where the run is started"
        )


def check_record_replay(retriever: RetrieverConfig, health: dict | None) -> None:
    """The replay store exists and opens, the record store can be created, and neither is pinned to another index
    than the one at retriever.url (from its /health `health`; a replay-only run probes it once and goes on without it
    when it does not answer). A recipe's own server is checked by the search clients, before their first live search.
    """
    try:
        replay, record = open_stores(retriever)
    except StoreError as exc:
        raise PreflightError(f"retriever.record / retriever.replay: {exc}") from exc
    if health is None and retriever.url and retriever.replay_only:
        try:
            resp = httpx.get(f"{retriever.url.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S)
            health = _json_or_empty(resp) if resp.status_code == 200 else None
        except httpx.HTTPError:
            logger.info("replaying from retriever.replay=%s without the retriever at %s", retriever.replay,
                        retriever.url)  # fmt: skip
    try:
        if health is not None:
            live = health_fingerprint(health)
            for store in {id(s): s for s in (replay, record) if s is not None}.values():
                check_fingerprint(store.path, store.fingerprint, live)
    except StoreMismatchError as exc:
        raise PreflightError(f"retriever.replay / retriever.record: {exc}") from exc
    finally:
        for store in (replay, record):
            if store is not None:
                store.close()


# ------------------------------------------------------------------------------------------------- hosts


class HostError(PlacementError):
    """A host of the cluster cannot run the workers: it does not see the run directory, a path of the config or the
    retrieval server (raised before any worker starts)."""


def host_problems(run_dir: str | None, paths: dict[str, str], url: str | None) -> list[str]:
    """Run on a host: what the workers there would miss (an empty list when nothing)."""
    problems = []
    if run_dir and not os.path.isfile(os.path.join(run_dir, "config.yaml")):
        problems.append(f"trainer.run_dir={run_dir} is not visible (its config.yaml is missing)")
    problems += [f"{key}={path} does not exist" for key, path in paths.items() if not os.path.exists(path)]
    if url:
        try:
            httpx.get(f"{url}/health", timeout=PROBE_TIMEOUT_S).raise_for_status()
        except httpx.HTTPError as exc:
            problems.append(f"retriever.url={url} does not answer GET /health ({exc!r})")
    return problems


def driver_paths(cfg: RSearchConfig) -> dict[str, str]:
    """The config's local paths the workers load (absolute, present on the driver's disk), by config key."""
    m = cfg.model
    keys = {"model.path": m.path, "model.tokenizer_path": m.tokenizer_path, "model.sft_checkpoint": m.sft_checkpoint}
    return {k: v for k, v in keys.items() if v and os.path.isabs(v) and os.path.exists(v)}


def store_paths(cfg: RSearchConfig, n_hosts: int) -> dict[str, str]:
    """The record / replay stores every host's rollout workers open (the preflight made them), by config key: on
    several hosts they must be absolute paths on a filesystem every host mounts (HostError otherwise)."""
    keys = {f"retriever.{k}": getattr(cfg.retriever, k) for k in ("record", "replay") if getattr(cfg.retriever, k)}
    for key, path in keys.items():
        if not os.path.isabs(path):
            raise HostError(
                f"{key}={path}: a cluster of {n_hosts} hosts needs an absolute path on a filesystem every host mounts "
                "at the same path (every rollout worker opens the store; docs/search_backends.md)"
            )
    return keys


def check_hosts(cfg: RSearchConfig, timeout_s: float = 60.0) -> None:
    """On a cluster of several hosts: fail fast (HostError) unless every other host sees trainer.run_dir, the config's
    local paths and the retrieval server -- a probe task on each host, before any worker starts. A loopback
    retriever.url is an error there (on another host it is that host's own loopback). One host: nothing to check."""

    here = ray.util.get_node_ip_address()
    others = [n for n in ray.nodes() if n.get("Alive") and n["NodeManagerAddress"] != here]
    if not others:
        return
    url = None if cfg.retriever.replay_only else cfg.retriever.url  # replay-only runs never reach the retriever
    if url and urlparse(url).hostname in ("127.0.0.1", "localhost", "::1"):
        raise HostError(
            f"retriever.url={url} is a loopback address, but the cluster has {len(others) + 1} hosts: workers on the "
            "others would reach their own loopback. Serve the retriever on an address every host can reach, or "
            "unset retriever.url to let the run start its own on this host's cluster address"
        )
    run_dir = cfg.trainer.run_dir
    if not run_dir or not os.path.isabs(run_dir):
        raise HostError(
            f"trainer.run_dir={run_dir!r}: a cluster of {len(others) + 1} hosts needs an absolute path on a "
            "filesystem every host mounts at the same path (checkpoints, published model files)"
        )
    probe = ray.remote(num_cpus=0)(host_problems)
    ips = [n["NodeManagerAddress"] for n in others]
    paths = {**driver_paths(cfg), **store_paths(cfg, len(others) + 1)}
    pending = [probe.options(resources={f"node:{ip}": 0.001}).remote(run_dir, paths, url) for ip in ips]
    problems = [
        f"host {ip}: {p}" for ip, found in zip(ips, ray.get(pending, timeout=timeout_s), strict=True) for p in found
    ]
    if problems:
        raise HostError(
            "the workers' hosts cannot run this config: "
            + "; ".join(problems)
            + ". trainer.run_dir must be on a filesystem every host shares; the retriever must be reachable from "
            "every host (see docs/cluster.md, Multi-host)"
        )


def _json_or_empty(resp: httpx.Response) -> dict:
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
