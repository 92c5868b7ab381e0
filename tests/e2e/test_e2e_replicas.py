"""The main job with `retriever.replicas=2`: the recipe's own retrieval server runs as two Ray Serve replicas (a real
local Ray of the server's own, beside the run's), one replica is SIGKILLed mid-run, and the run goes on: Serve
replaces the replica, the searches in flight are retried by the client, no search fails and no trajectory is
dropped (docs/retriever.md "Scale-out on Ray Serve"). ~1.5 min on 2 cores with the searching policy built.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import pytest
from e2e_helpers import FAST, ROOT, child_env, main_cmd, read_metrics

from retrieval_server.replicas import haproxy_pids
from rsearch_verl.testing.processes import descendants

REPLICA = "ServeReplica:retriever:RetrieverReplica"


def replicas_of(proc: subprocess.Popen) -> list[psutil.Process]:
    return descendants(proc.pid, REPLICA)


def wait_until(cond, proc: subprocess.Popen, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not cond():
        assert proc.poll() is None, f"driver exited ({proc.returncode}) before {what}"
        assert time.monotonic() - start < timeout, f"no {what} within {timeout} s"
        time.sleep(0.2)
    return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_run_on_two_serve_replicas_survives_a_killed_replica(tmp_path, toy_cache, searching_policy):
    run_dir = tmp_path / "run"
    haproxy_before = haproxy_pids()
    overrides = [*FAST, f"model.sft_checkpoint={searching_policy}", "retriever.replicas=2", "trainer.total_steps=8"]
    with open(str(run_dir) + ".log", "w") as log:
        proc = subprocess.Popen(
            main_cmd("search_r1_grpo", run_dir, toy_cache, *overrides),
            cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        first_ckpt = os.path.join(str(run_dir), "checkpoints", "step_000001", "COMPLETE")
        wait_until(lambda: os.path.exists(first_ckpt), proc, 900, "checkpoint of step 1")
        before = replicas_of(proc)
        assert len(before) == 2, [p.cmdline() for p in before]
        victim = before[0].pid
        os.kill(victim, signal.SIGKILL)
        replaced_s = wait_until(
            lambda: len(pids := {p.pid for p in replicas_of(proc)}) == 2 and victim not in pids,
            proc, 60, "replacement replica",
        )  # fmt: skip
        code = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log_text = (tmp_path / "run.log").read_text()
    assert code == 0, log_text[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["search/errors"] == 0 and r["rollout/searches_mean"] > 0 for r in rows), rows
    health = json.loads((run_dir / "summary.json").read_text())["health"]
    assert health["dropped_trajectories"] == 0 and health["retriever_restarts"] == 0, health
    retried = sum(r["search/retries"] for r in rows)
    assert retried <= 10, retried  # at most what was in flight on the killed replica
    assert replaced_s < 60
    assert haproxy_pids() <= haproxy_before, "the server's HAProxy outlived the run"
