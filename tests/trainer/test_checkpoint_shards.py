"""A checkpoint is complete only with every rank's shard files: what a run_dir that is not shared between hosts
leaves behind (each rank wrote on its own disk) is never marked complete, saving it stops the run naming
trainer.run_dir, and resume falls back to the newest complete checkpoint.

The worker checkpoints are real ones (`sharded_checkpoint.save_checkpoint`, DCP, one process); a second rank's
absence is made by recording a world size of 2 or by deleting a DCP data file.
Run: .venv/bin/python -m pytest -q tests/trainer/test_checkpoint_shards.py
"""

import os
import shutil

import pytest
import torch

from rsearch_verl.trainer.checkpoint import (
    CheckpointManager,
    IncompleteCheckpointError,
    is_complete,
    missing_shards,
)
from rsearch_verl.trainer.health import RunStopped
from rsearch_verl.workers.sharded_checkpoint import missing_files, save_checkpoint


def _worker_ckpt(path: str, world_size: int = 1) -> None:
    """A real one-rank worker checkpoint; `world_size` > 1 pretends other ranks wrote theirs elsewhere."""
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    save_checkpoint(path, model, optim)
    if world_size > 1:
        local = torch.load(os.path.join(path, "rank0.pt"), weights_only=False)
        torch.save({**local, "world_size": world_size}, os.path.join(path, "rank0.pt"))


def _save(ckpts: CheckpointManager, step: int, world_size: int = 1, write_actor: bool = True) -> None:
    with ckpts.writing(step, parts=("actor",)) as tmp:
        if write_actor:
            _worker_ckpt(os.path.join(tmp, "actor"), world_size)
        ckpts.write_trainer_state(tmp, {"step": step})


def test_missing_files_of_a_real_dcp_checkpoint(tmp_path):
    path = str(tmp_path / "actor")
    _worker_ckpt(path)
    assert missing_files(path) == []
    data = [n for n in os.listdir(os.path.join(path, "dcp")) if n.endswith(".distcp")]
    assert data, "DCP wrote no data file"
    os.remove(os.path.join(path, "dcp", data[0]))
    assert missing_files(path) == [f"dcp/{data[0]}"]
    assert missing_files(str(tmp_path / "nowhere")) == ["(the directory)"]


def test_other_ranks_shards_missing_stop_the_save(tmp_path):
    ckpts = CheckpointManager(str(tmp_path / "run"))
    _save(ckpts, 1)
    with pytest.raises(IncompleteCheckpointError, match=r"trainer\.run_dir=.*run") as info:
        _save(ckpts, 2, world_size=2)
    assert "actor/rank1.pt" in str(info.value)
    assert isinstance(info.value, RunStopped)  # python -m rsearch_verl.main exits 3 with the message
    assert [s for s, _ in ckpts.complete_checkpoints()] == [1]
    assert not [n for n in os.listdir(ckpts.root) if n.startswith(".tmp-")]


def test_a_part_written_on_another_host_entirely(tmp_path):
    """Rank 0 on another host: the driver sees no actor directory at all."""
    ckpts = CheckpointManager(str(tmp_path))
    with pytest.raises(IncompleteCheckpointError, match="actor/"):
        _save(ckpts, 1, write_actor=False)
    assert ckpts.latest() is None


def test_resume_falls_back_past_a_checkpoint_marked_complete_without_its_shards(tmp_path):
    """A checkpoint written before this check (COMPLETE without every shard) is skipped by resume=auto."""
    ckpts = CheckpointManager(str(tmp_path), max_to_keep=0)
    _save(ckpts, 1)
    _save(ckpts, 2)
    newest = ckpts.latest()
    assert newest.endswith("step_000002") and is_complete(newest)
    os.remove(os.path.join(newest, "actor", "rank0.pt"))  # as if rank 0 had written it on its own host
    assert missing_shards(newest) == ["actor/rank0.pt"]
    assert not is_complete(newest)
    assert ckpts.resolve("auto").endswith("step_000001")
    # the COMPLETE marker names the parts: a step without its actor directory is not complete either
    shutil.rmtree(os.path.join(newest, "actor"))
    assert not is_complete(newest)
    assert ckpts.resolve("auto").endswith("step_000001")
