"""Fault injection on real runs: the main job (`python -m rsearch_verl.main`, a local Ray, the real retrieval server)
meets the faults a long run meets, and must never degrade silently (docs/health.md).

1. The recipe's own retrieval server is SIGKILLed mid-run, and a NaN is injected into the loss at step 3
   (`RSEARCH_FAULT_NAN_LOSS_STEP`): the server is restarted and searches succeed again, every trajectory that saw a
   failed search is marked and dropped from the update, the watchdog rolls back to step 2 at half the lr, the run
   exits 0 and summary.json records both.
2. An external `retriever.url` on a dead port: exit 3 at start with a message naming retriever.url. Then an external
   server that goes away for good mid-run: the run checkpoints and exits 3 within its deadline; once the server is
   back, `trainer.resume=auto` continues -- until a Ray worker is SIGKILLed mid-step: exit 3 with a clear error; the
   next `trainer.resume=auto` finishes the run.

The policy must search for any of this to matter, and a random tiny policy never does: a module fixture fine-tunes
the tiny policy for a few seconds on toy world demonstrations that always search (`searching_policy`; no warm start).
The slow retriever case is tests/rollout/test_rollout_breaker.py (real uvicorn server, real agent loop).
Outage and recovery times are logged (pytest -o log_cli=true --log-cli-level=INFO).
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
from e2e_helpers import ROOT, TINY, child_env, hf_weights, main_cmd, read_metrics

logger = logging.getLogger(__name__)
RECIPE = "search_r1_grpo"
# 2 prompts x 2 samples per step, a checkpoint every step, no validation: only what the faults need
FAST = [
    "rollout.n=2",
    "trainer.save_freq=1",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "rollout.max_tokens_per_turn=40",
    "rollout.temperature=0.5",  # the short-trained policy below searches in every trajectory at 0.5
    "retriever.supervisor.check_interval_s=0.5",
]


@pytest.fixture(scope="module")
def searching_policy(toy_cache, tmp_path_factory) -> str:
    """The tiny policy after a short SFT (~40 s on 2 busy cores) on the first turn of toy world demonstrations that
    always search (`<search> the birthplace of X </search>`): an HF dir for model.sft_checkpoint."""
    import torch

    from rsearch_verl.config import load_config
    from rsearch_verl.data.toy_world import build_toy_world, toy_tokenizer
    from rsearch_verl.sft import SFTOptions, load_policy, save_hf, train_sft
    from rsearch_verl.warm_start import toy_demos

    cfg = load_config([f"+recipe={RECIPE}", *TINY, *FAST, f"data.toy_world.cache_dir={toy_cache}"])
    cfg.model.tokenizer_path = toy_tokenizer(build_toy_world(cfg.data.toy_world), [cfg.rollout.protocol])
    model, tokenizer = load_policy(cfg, seed=0)
    demos = []
    for demo in toy_demos(cfg, n=32, p_no_search=0.0, seed=1):
        first = demo["segments"][0][1]
        demos.append({"prompt": demo["prompt"], "segments": [("policy", first[first.index("<search>") :])]})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two shared cores were ~10x slower here
    try:
        train_sft(model, tokenizer, demos, SFTOptions(epochs=10, lr=3e-3, warmup_steps=2, schedule="constant"))
    finally:
        torch.set_num_threads(threads)
    return save_hf(model, tokenizer, str(tmp_path_factory.mktemp("policy") / "searching"))


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
        cmd, cwd=ROOT, env={**child_env(), **(env or {})}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
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


def _descendant(proc: subprocess.Popen, marker: str) -> psutil.Process:
    """The one process under the driver whose command line contains `marker` (never someone else's)."""
    found = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if marker in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    assert len(found) == 1, f"{len(found)} processes match {marker!r}"
    return found[0]


def _ckpt(run_dir, step: int) -> str:
    return os.path.join(str(run_dir), "checkpoints", f"step_{step:06d}")


def _rollout_lines(run_dir) -> list[dict]:
    lines = []
    for path in sorted(glob.glob(os.path.join(str(run_dir), "rollouts", "step_*.jsonl"))):
        with open(path) as f:
            lines += [json.loads(line) for line in f]
    return lines


@pytest.mark.slow
@pytest.mark.timeout(2400)  # several runs; ~1-2 min each on an idle 2-core machine, far more on a shared busy one
def test_retriever_killed_and_nan_loss_run_completes(tmp_path, toy_cache, searching_policy):
    run_dir = tmp_path / "run"
    nan_at_3 = {"RSEARCH_FAULT_NAN_LOSS_STEP": "3"}
    proc = _start(run_dir, toy_cache, searching_policy, "trainer.total_steps=4", env=nan_at_3)
    _wait_for(os.path.join(_ckpt(run_dir, 1), "COMPLETE"), proc)
    server = _descendant(proc, "retrieval_server serve")
    time.sleep(0.5)  # into step 2's rollout
    server.kill()
    killed = time.monotonic()
    code, log = _finish(proc, run_dir)
    assert code == 0, log[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    summary = json.loads((run_dir / "summary.json").read_text())
    health = summary["health"]
    # 1. the retriever outage: restarted, recorded, searches work again on the next step
    assert health["status"] == "degraded" and health["retriever_restarts"] >= 1 and health["outages"], health
    restarted = [r["step"] for r in rows if r["retriever/restarts"] > 0]
    assert restarted and restarted[0] in (2, 3)
    after = [r for r in rows if r["step"] > restarted[0]]
    assert after and all(r["search/errors"] == 0 and r["rollout/searches_mean"] > 0 for r in after), after
    # no trajectory with a failed search reaches the update unmarked: each one is dropped (uid marked, no loss)
    failed = [line for line in _rollout_lines(run_dir) if "search failed" in line["response"]]
    assert all("#dropped" in line["uid"] for line in failed), [line["uid"] for line in failed]
    assert health["dropped_trajectories"] == sum(r["rollout/dropped_trajectories"] for r in rows) >= len(failed)
    logger.info(
        "retriever SIGKILLed mid-step 2: down %.2f s (driver-measured), %d restart(s), %d trajectory(ies) dropped; "
        "run exited 0 %.0f s after the kill",
        health["retriever_down_s"], health["retriever_restarts"], health["dropped_trajectories"],
        time.monotonic() - killed,
    )  # fmt: skip
    # 4. the NaN at step 3: rolled back to step 2 at half the lr; the metrics show the trip; the weights are finite
    (rollback,) = health["rollbacks"]
    assert (rollback["step"], rollback["restored_step"], list(rollback["trips"])) == (3, 2, ["nonfinite"])
    step3 = rows[2]
    assert step3["health/trip_nonfinite"] == 1 and step3["health/rolled_back_from"] == 3
    assert step3["health/rollbacks"] == 1 and rows[1]["health/rollbacks"] == 0
    assert step3["actor/lr"] == pytest.approx(rows[1]["actor/lr"] * 0.5)
    assert math.isfinite(step3["actor/pg_loss"]) and math.isfinite(step3["actor/grad_norm"])
    final = hf_weights(_ckpt(run_dir, 4))
    assert all(bool(w.float().isfinite().all()) for w in final.values())
    assert "health watchdog tripped at step 3" in log


@pytest.mark.slow
@pytest.mark.timeout(2400)  # several runs; ~1-2 min each on an idle 2-core machine, far more on a shared busy one
def test_external_retriever_gone_then_worker_killed_resume_finishes(tmp_path, toy_cache, searching_policy):
    from rsearch_verl.config import load_config
    from rsearch_verl.data.toy_world import build_toy_world
    from rsearch_verl.trainer.retriever_service import ensure_index, free_port, wait_healthy

    run_dir = tmp_path / "run"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # a dead retriever.url: a clear error before any step
    start = time.monotonic()
    proc = _start(tmp_path / "dead", toy_cache, searching_policy, f"retriever.url={url}", "retriever.start_timeout_s=2")
    code, log = _finish(proc, tmp_path / "dead")
    assert code == 3 and f"retriever.url={url} does not answer GET /health" in log, log[-3000:]
    logger.info("dead retriever.url: exit 3 after %.0f s", time.monotonic() - start)

    cfg = load_config([f"+recipe={RECIPE}", *TINY, f"data.toy_world.cache_dir={toy_cache}"])
    world = build_toy_world(cfg.data.toy_world)
    index = ensure_index(cfg.retriever, world.corpus_path, str(tmp_path / "index"))
    serve = [sys.executable, "-m", "retrieval_server", "serve", "--index", index, "--port", str(port)]

    def external_server() -> subprocess.Popen:
        server = subprocess.Popen(
            serve, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        _STARTED.append(server)
        wait_healthy(url, 120, server)
        return server

    args = [f"retriever.url={url}", "trainer.total_steps=4", "retriever.breaker.deadline_s=5"]
    # 2. the external server goes away for good after step 1: checkpoint, exit 3 within the deadline
    server = external_server()
    proc = _start(run_dir, toy_cache, searching_policy, *args)
    _wait_for(os.path.join(_ckpt(run_dir, 1), "COMPLETE"), proc)
    server.kill()
    server.wait()
    killed = time.monotonic()
    code, log = _finish(proc, run_dir)
    stopped_s = time.monotonic() - killed
    assert code == 3, log[-4000:]
    assert f"retriever.url={url}" in log and "trainer.resume=auto" in log, log[-3000:]
    assert stopped_s < 90, stopped_s
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["health"]["status"] == "stopped" and "retriever" in summary["health"]["stop"]["reason"]
    done = [s for s in (1, 2) if os.path.isfile(os.path.join(_ckpt(run_dir, s), "COMPLETE"))]
    assert done and not glob.glob(os.path.join(str(run_dir), "checkpoints", ".tmp-*"))
    logger.info("external retriever killed: exit 3 %.1f s later, checkpoint of step %d", stopped_s, done[-1])

    # 5. the retriever is back: resume=auto continues from that checkpoint; a Ray worker SIGKILLed mid-step stops it
    server = external_server()
    try:
        proc = _start(run_dir, toy_cache, searching_policy, *args)
        _wait_for(os.path.join(_ckpt(run_dir, done[-1] + 1), "COMPLETE"), proc)
        time.sleep(0.5)
        _descendant(proc, "ActorWorker").kill()
        code, log = _finish(proc, run_dir)
        assert code == 3, log[-4000:]
        assert f"resuming from {_ckpt(run_dir, done[-1])}" in log
        assert "a Ray worker died" in log and "trainer.resume=auto" in log, log[-3000:]
        # and resume=auto finishes the run
        proc = _start(run_dir, toy_cache, searching_policy, *args)
        code, log = _finish(proc, run_dir)
        assert code == 0, log[-4000:]
    finally:
        server.kill()
        server.wait()
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == [1, 2, 3, 4]
    health = json.loads((run_dir / "summary.json").read_text())["health"]
    assert health["status"] == "degraded" and health["interruptions"], health
