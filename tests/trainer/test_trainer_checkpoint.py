"""Checkpoint directory management: atomic completion, a write killed midway is ignored, resume resolution."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from rsearch_verl.trainer.checkpoint import CheckpointError, CheckpointManager, is_complete


def _save(ckpts: CheckpointManager, step: int) -> None:
    with ckpts.writing(step) as tmp:
        torch.save({"w": torch.full((3,), float(step))}, os.path.join(tmp, "model.pt"))
        ckpts.write_trainer_state(tmp, {"step": step})


def test_latest_and_pruning(tmp_path):
    ckpts = CheckpointManager(str(tmp_path), max_to_keep=2)
    for step in (1, 2, 3):
        _save(ckpts, step)
    steps = [s for s, _ in ckpts.complete_checkpoints()]
    assert steps == [2, 3]
    assert ckpts.resolve("auto").endswith("step_000003")
    assert ckpts.resolve("disable") is None
    assert torch.load(os.path.join(ckpts.latest(), "model.pt"))["w"][0] == 3.0


def test_exception_mid_write_leaves_nothing(tmp_path):
    ckpts = CheckpointManager(str(tmp_path))
    _save(ckpts, 1)
    with pytest.raises(RuntimeError), ckpts.writing(2) as tmp:
        torch.save({"w": 1}, os.path.join(tmp, "model.pt"))
        raise RuntimeError("worker died")
    assert [s for s, _ in ckpts.complete_checkpoints()] == [1]
    assert not [n for n in os.listdir(ckpts.root) if n.startswith(".tmp-")]


def test_process_killed_mid_write_is_ignored_and_swept(tmp_path):
    """SIGKILL while a checkpoint is half written: resume=auto picks the previous complete one."""
    ckpts = CheckpointManager(str(tmp_path))
    _save(ckpts, 1)
    script = textwrap.dedent(
        f"""
        import os, time, torch
        from rsearch_verl.trainer.checkpoint import CheckpointManager
        ckpts = CheckpointManager({str(tmp_path)!r})
        with ckpts.writing(2) as tmp:
            torch.save({{"w": 2}}, os.path.join(tmp, "model.pt"))
            print("writing", flush=True)
            time.sleep(60)
            ckpts.write_trainer_state(tmp, {{"step": 2}})
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    leftovers = [n for n in os.listdir(ckpts.root) if n.startswith(".tmp-")]
    assert leftovers, "the killed writer should have left its temporary directory"
    assert ckpts.resolve("auto").endswith("step_000001")
    ckpts.sweep_incomplete()
    assert not [n for n in os.listdir(ckpts.root) if n.startswith(".tmp-")]


def test_explicit_incomplete_path_is_an_error(tmp_path):
    ckpts = CheckpointManager(str(tmp_path))
    bogus = tmp_path / "checkpoints" / "step_000009"
    bogus.mkdir()
    (bogus / "trainer_state.json").write_text(json.dumps({"step": 9}))
    assert not is_complete(str(bogus))
    assert ckpts.resolve("auto") is None  # no COMPLETE marker: not a checkpoint
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        ckpts.resolve(str(bogus))


def test_driver_rng_round_trip(tmp_path):
    ckpts = CheckpointManager(str(tmp_path))
    torch.manual_seed(123)
    _save(ckpts, 1)
    expected = torch.rand(4)
    torch.manual_seed(999)
    state = ckpts.read_trainer_state(ckpts.latest())
    assert state == {"step": 1}
    assert torch.equal(torch.rand(4), expected)
