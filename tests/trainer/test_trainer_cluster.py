"""`launch/submit.sh` against a real local Ray cluster: `ray start --head`, `ray job submit` of a 1-step run,
the job succeeds and its run directory has metrics and a checkpoint."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from rsearch_verl.testing.processes import wait_http_ok

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    gcs, dash = _free_port(), _free_port()
    # a loopback-only test cluster: Ray's token auth (on by default for new clusters) is switched off
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "PATH": f"{BIN}:{os.environ['PATH']}",
    }
    env.pop("RAY_ADDRESS", None)
    cmd = [os.path.join(BIN, "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2"]
    cmd += ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}"]
    # a short temp dir: Ray's unix socket paths under pytest's deep tmp_path exceed the 107-byte limit
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    cmd += [f"--temp-dir={temp_dir}", "--object-store-memory=536870912"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://127.0.0.1:{dash}"
    if not wait_http_ok(f"{address}/api/version", timeout_s=90, interval_s=1):
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("ray head did not start")
    yield address, env
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_submit_one_step_job(ray_head, tmp_path):
    address, env = ray_head
    run_dir = tmp_path / "run"
    env = {**env, "RAY_ADDRESS": address, "PYTHON": sys.executable, "RAY": os.path.join(BIN, "ray")}
    overrides = [
        "+recipe=search_r1_grpo",
        "model.sft_checkpoint=null",  # plumbing only: no warm start build inside the job
        "trainer.total_steps=1",
        "rollout.n=2",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=4",
        "data.val_max_samples=4",
        "rollout.max_turns=2",
        "rollout.max_tokens_per_turn=24",
        f"trainer.run_dir={run_dir}",
        f"data.toy_world.cache_dir={tmp_path / 'toy'}",
    ]
    for _ in range(30):  # the head's job agent registers a while after the dashboard answers (longer under load)
        done = subprocess.run(
            ["bash", os.path.join(ROOT, "launch", "submit.sh"), *overrides],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=480,
        )
        if "No available agent" not in done.stdout + done.stderr:
            break
        time.sleep(2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "succeeded" in (done.stdout + done.stderr).lower()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert os.path.isdir(run_dir / "checkpoints" / "step_000001")
