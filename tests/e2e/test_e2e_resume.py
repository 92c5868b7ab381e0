"""Crash and resume: a run of 4 steps equals a run of 2 steps + SIGKILL of the driver + `trainer.resume=auto` for the
remaining 2 (actor parameters equal within 1e-6 on CPU), and a checkpoint killed mid-write is ignored, not loaded;
a fresh run (`trainer.resume=disable`) in the same directory does not append to the old run's metrics.

The driver is a real `python -m rsearch_verl.main` process in its own process group (with its local Ray cluster
and retrieval server); the kill is SIGKILL to the whole group right after the step-2 checkpoint is complete."""

import os
import signal
import subprocess
import time

import pytest
from e2e_helpers import ROOT, child_env, hf_weights, main_cmd, read_metrics, run_main

# GRPO with KL loss: exercises sampling seeds, the dataloader state, optimizer state and the reference model.
OVERRIDES = ["trainer.total_steps=4", "trainer.save_freq=2", "trainer.test_freq=0", "rollout.n=2"]
# ... on folded trajectories (rollout/context.py): a policy that searches, 4 turns in a context of 280 tokens, so a
# trajectory's second search folds it into rows (the loader state and the rows' padding must resume exactly too)
FOLD = ["rollout.max_turns=4", "rollout.context.strategy=drop_observations", "rollout.context.max_tokens=280",
        "data.max_prompt_length=160", "rollout.temperature=0.5"]  # fmt: skip


def _kill_after_checkpoint(cmd: list[str], ckpt: str, timeout: float = 420) -> None:
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=child_env(), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + timeout
    try:
        while not os.path.isfile(os.path.join(ckpt, "COMPLETE")):
            assert proc.poll() is None, f"driver exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "no step-2 checkpoint in time"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_kill_and_resume_equals_uninterrupted(tmp_path, toy_cache, searching_policy):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    overrides = [*OVERRIDES, *FOLD, f"model.sft_checkpoint={searching_policy}"]
    run_main("search_r1_grpo", straight, toy_cache, *overrides)
    assert max(r.get("rollout/folds_max", 0) for r in read_metrics(straight)) >= 1  # trajectories did fold

    _kill_after_checkpoint(
        main_cmd("search_r1_grpo", crashed, toy_cache, *overrides), str(crashed / "checkpoints" / "step_000002")
    )
    # a checkpoint killed mid-write: a temporary directory with a partial shard, and no COMPLETE marker
    partial = crashed / "checkpoints" / ".tmp-step_000003-deadbeef"
    (partial / "actor").mkdir(parents=True)
    (partial / "actor" / "model_rank0.pt").write_bytes(b"\x00" * 100)

    done = run_main("search_r1_grpo", crashed, toy_cache, *overrides, "trainer.resume=auto")
    assert "resuming from" in done.stderr and "step_000002" in done.stderr
    assert not partial.exists(), "the partial checkpoint was not swept"

    a = hf_weights(str(straight / "checkpoints" / "step_000004"))
    b = hf_weights(str(crashed / "checkpoints" / "step_000004"))
    assert a.keys() == b.keys()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst <= 1e-6, f"resumed run differs from the uninterrupted one by {worst}"
    steps = [r["step"] for r in read_metrics(crashed)]
    assert steps == sorted(set(steps)) and steps[-1] == 4
    # a fresh run in the same directory (resume=disable) starts a fresh metrics.jsonl
    run_main("search_r1_grpo", crashed, toy_cache, *OVERRIDES, "trainer.resume=disable", "trainer.total_steps=1")
    assert [r["step"] for r in read_metrics(crashed)] == [0, 1]
