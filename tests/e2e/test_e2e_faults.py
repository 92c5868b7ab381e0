"""Fault injection on real runs: the main job (`python -m rsearch_verl.main`, a local Ray, the real retrieval server)
meets the faults a long run meets, one after the other, and must never degrade silently (docs/health.md). One run
directory, three processes:

1. An external `retriever.url` server is SIGKILLed for good after step 1: the run checkpoints and exits 3 within its
   deadline (retriever.breaker.deadline_s=5), with a message naming retriever.url and trainer.resume=auto.
2. The server is back; `trainer.resume=auto` continues from that checkpoint, until a Ray worker is SIGKILLed mid-step:
   exit 3 with a clear error.
3. `trainer.resume=auto` again, now with the recipe's own retrieval server, which is SIGKILLed mid-run, and a NaN
   injected into the loss at the last step (rsearch_verl/testing/faults.py): the server is restarted and searches
   succeed again, every trajectory that saw a failed search is marked and dropped from the update, the watchdog rolls
   back to the previous checkpoint at half the lr, the run finishes with exit 0, and summary.json records it all.

The policy must search for any of this to matter, and a random tiny policy never does: a module fixture fine-tunes
the tiny policy for a few seconds on the first turn of toy world demonstrations (`searching_policy`; no warm start).
A retriever slower than the client timeout is tests/rollout/test_rollout_breaker.py (real uvicorn server, real agent
loop); a dead retriever.url at start is tests/trainer/test_trainer_supervisor.py. Outage and recovery times are logged
(pytest -o log_cli=true --log-cli-level=INFO).
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from e2e_helpers import FAST, ROOT, TINY, child_env, hf_weights, main_cmd, read_metrics

from rsearch_verl.testing.faults import nan_loss_env
from rsearch_verl.testing.processes import descendants

logger = logging.getLogger(__name__)
RECIPE = "search_r1_grpo"


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_orphans():
    """Whatever a test started is gone after it, even when it fails or times out (a driver has its own session)."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _start(run_dir, toy_cache: str, policy: str, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    cmd = main_cmd(RECIPE, run_dir, toy_cache, *FAST, f"model.sft_checkpoint={policy}", *overrides)
    log = open(os.path.join(str(run_dir) + ".log"), "w")  # noqa: SIM115 - closed with the process by the OS
    os.makedirs(run_dir, exist_ok=True)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=child_env(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    _STARTED.append(proc)
    return proc


def _finish(proc: subprocess.Popen, run_dir, timeout: float = 900) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    with open(str(run_dir) + ".log") as f:
        return code, f.read()


def _wait_for(path: str, proc: subprocess.Popen, timeout: float = 900) -> float:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, f"driver exited early with {proc.returncode}"
        assert time.monotonic() < deadline, f"no {path} in time"
        time.sleep(0.1)
    return time.monotonic()


def _descendant(proc: subprocess.Popen, marker: str, run_dir, timeout: float = 60) -> psutil.Process:
    """The one process under the driver whose command line contains `marker` (never someone else's). Polled: on a
    busy machine the driver may be restarting it (its supervisor) at the moment the test looks."""
    deadline = time.monotonic() + timeout
    while len(found := descendants(proc.pid, marker)) != 1 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    if len(found) != 1:
        with open(str(run_dir) + ".log") as f:
            log = f.read()
        raise AssertionError(f"{len(found)} processes match {marker!r} (driver: {proc.poll()}); log:\n{log[-4000:]}")
    return found[0]


def _newest_checkpoint(run_dir) -> int:
    steps = glob.glob(os.path.join(str(run_dir), "checkpoints", "step_*", "COMPLETE"))
    return max(int(os.path.basename(os.path.dirname(path)).split("_")[1]) for path in steps)


def _ckpt(run_dir, step: int) -> str:
    return os.path.join(str(run_dir), "checkpoints", f"step_{step:06d}")


def _rollout_lines(run_dir) -> list[dict]:
    lines = []
    for path in sorted(glob.glob(os.path.join(str(run_dir), "rollouts", "step_*.jsonl"))):
        with open(path) as f:
            lines += [json.loads(line) for line in f]
    return lines


@pytest.mark.slow
@pytest.mark.timeout(2400)  # three runs: ~1 min each on an idle 2-core machine, far more on a shared busy one
def test_a_run_survives_outages_a_dead_worker_and_a_nan(tmp_path, toy_cache, searching_policy):
    from rsearch_verl.config import load_config
    from rsearch_verl.search.service import ensure_index, free_port, wait_healthy
    from rsearch_verl.toy.world import build_toy_world

    run_dir, port = tmp_path / "run", free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = load_config([f"+recipe={RECIPE}", *TINY, f"data.toy_world.cache_dir={toy_cache}"])
    index = ensure_index(cfg.retriever, build_toy_world(cfg.data.toy_world).corpus_path, str(tmp_path / "index"))
    serve = [sys.executable, "-m", "retrieval_server", "serve", "--index", index, "--port", str(port)]

    def external_server() -> subprocess.Popen:
        server = subprocess.Popen(
            serve, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        _STARTED.append(server)
        wait_healthy(url, 120, server)
        return server

    # 1. the external server goes away for good after step 1: checkpoint, exit 3 within the deadline
    external = [f"retriever.url={url}", "trainer.total_steps=7", "retriever.breaker.deadline_s=5"]
    server = external_server()
    proc = _start(run_dir, toy_cache, searching_policy, *external)
    _wait_for(os.path.join(_ckpt(run_dir, 1), "COMPLETE"), proc)
    server.kill()
    server.wait()
    killed = time.monotonic()
    code, log = _finish(proc, run_dir)
    stopped_s = time.monotonic() - killed
    assert code == 3, log[-4000:]
    assert f"retriever.url={url}" in log and "trainer.resume=auto" in log, log[-3000:]
    assert stopped_s < 90, stopped_s
    health = json.loads((run_dir / "summary.json").read_text())["health"]
    assert health["status"] == "stopped" and "retriever" in health["stop"]["reason"]
    done = [s for s in (1, 2) if os.path.isfile(os.path.join(_ckpt(run_dir, s), "COMPLETE"))]
    assert done and not glob.glob(os.path.join(str(run_dir), "checkpoints", ".tmp-*"))
    logger.info("external retriever killed: exit 3 %.1f s later, checkpoint of step %d", stopped_s, done[-1])

    # 2. the server is back: resume=auto continues from that checkpoint; a Ray worker SIGKILLed mid-step stops it
    server = external_server()
    proc = _start(run_dir, toy_cache, searching_policy, *external)
    _wait_for(os.path.join(_ckpt(run_dir, done[-1] + 1), "COMPLETE"), proc)
    time.sleep(0.3)
    _descendant(proc, "ActorWorker", run_dir).kill()
    code, log = _finish(proc, run_dir)
    server.kill()
    assert code == 3, log[-4000:]
    assert f"resuming from {_ckpt(run_dir, done[-1])}" in log
    assert "a Ray worker died" in log and "trainer.resume=auto" in log, log[-3000:]
    resumed = _newest_checkpoint(run_dir)  # done[-1] + 1, unless the worker's death came after one more step
    assert resumed > done[-1], resumed

    # 3. resume=auto with the recipe's own server: it is SIGKILLed mid-run; the loss is NaN at step 7
    proc = _start(run_dir, toy_cache, searching_policy, "trainer.total_steps=7", env=nan_loss_env(7))
    _wait_for(os.path.join(_ckpt(run_dir, resumed + 1), "COMPLETE"), proc)
    _descendant(proc, "retrieval_server serve", run_dir).kill()  # during the next step (its check or its rollout)
    killed = time.monotonic()
    code, log = _finish(proc, run_dir)
    assert code == 0, log[-4000:]
    assert f"resuming from {_ckpt(run_dir, resumed)}" in log
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 8))
    health = json.loads((run_dir / "summary.json").read_text())["health"]
    assert health["status"] == "degraded" and health["interruptions"], health
    # the own server was restarted and searches succeed again from the next step on
    assert health["retriever_restarts"] >= 1 and health["outages"][-1]["recovered"], health
    restarted = [r["step"] for r in rows if r["retriever/restarts"] > 0]
    assert restarted and resumed + 2 <= restarted[0] <= 6, restarted
    after = [r for r in rows if r["step"] > restarted[0]]
    assert all(r["search/errors"] == 0 and r["rollout/searches_mean"] > 0 for r in after), after
    # no trajectory with a failed search reaches the update unmarked: each one is dropped (uid marked, no loss)
    failed = [line for line in _rollout_lines(run_dir) if "search failed" in line["response"]]
    assert all("#dropped" in line["uid"] for line in failed), [line["uid"] for line in failed]
    assert health["dropped_trajectories"] >= len(failed)
    logger.info(
        "own retriever SIGKILLed after step %d: down %.2f s (driver-measured), %d restart(s), %d trajectory(ies) "
        "dropped; the run exited 0 %.0f s after the kill",
        resumed + 1, health["outages"][-1]["down_s"], health["outages"][-1]["restarts"], health["dropped_trajectories"],
        time.monotonic() - killed,
    )  # fmt: skip
    # the NaN at step 7: rolled back to step 6 at half the lr; the metrics show the trip; the weights are finite
    (rollback,) = health["rollbacks"]
    assert (rollback["step"], rollback["restored_step"], list(rollback["trips"])) == (7, 6, ["nonfinite"])
    last, before = rows[-1], rows[-2]
    assert last["health/trip_nonfinite"] == 1 and last["health/rolled_back_from"] == 7 and last["health/rollbacks"] == 1
    assert before["health/rollbacks"] == 0 and last["actor/lr"] == pytest.approx(before["actor/lr"] * 0.5)
    assert math.isfinite(last["actor/pg_loss"]) and math.isfinite(last["actor/grad_norm"])
    assert all(bool(w.float().isfinite().all()) for w in hf_weights(_ckpt(run_dir, 7)).values())
    assert "health watchdog tripped at step 7" in log
