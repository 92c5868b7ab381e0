"""Atomic, resumable checkpoints in `<run_dir>/checkpoints/step_<N>/`.

A checkpoint is written into a hidden temporary directory next to its final place (`.tmp-step_<N>-<random>`);
the workers write their shards into it, the driver writes `trainer_state.json` (step, dataloader state, KL
schedule) and `driver_rng.pt`, checks that every rank's shard files are there (`missing_shards`), writes `COMPLETE`
(naming the worker parts), and only then is the directory renamed to `step_<N>`. A rename is atomic on one
filesystem, so a process killed mid-write leaves only a temporary directory, which `latest()` ignores and
`sweep_incomplete()` removes: a half-written checkpoint is never loaded. A checkpoint whose shards are not all there
is never complete: saving it stops the run (`IncompleteCheckpointError`, exit 3, naming trainer.run_dir) and resuming
skips it for the newest complete one.

`run_dir` needs a filesystem with POSIX rename (atomic, of a whole directory) that the driver and every worker see:
a local disk on one host, or NFS / Lustre / a similar shared filesystem across hosts. Object-store mounts (s3fs,
gcsfuse, a mounted bucket) do not rename directories atomically: a kill mid-rename can leave a partial `step_<N>`.

Usage:
    ckpts = CheckpointManager(run_dir, max_to_keep=2)
    with ckpts.writing(step, parts=("actor",)) as tmp:   # tmp: the directory to fill; parts: worker checkpoints in it
        actor_wg.save_checkpoint(os.path.join(tmp, "actor"))
        ckpts.write_trainer_state(tmp, {...})
    path = ckpts.resolve(cfg.trainer.resume)  # "auto" | "disable" | a path -> a complete checkpoint or None
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Sequence

import torch

from rsearch_verl.rng import capture_rng, restore_rng
from rsearch_verl.trainer.health import RunStopped
from rsearch_verl.workers.sharded_checkpoint import missing_files

logger = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
RNG_FILE = "driver_rng.pt"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint asked for explicitly is missing or incomplete."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


class IncompleteCheckpointError(CheckpointError, RunStopped):
    """Worker shards did not arrive where the driver writes the checkpoint (trainer.run_dir not shared)."""


def step_parts(path: str) -> list[str]:
    """The worker parts a COMPLETE marker names (older markers name none: the parts present are checked)."""
    try:
        with open(os.path.join(path, COMPLETE)) as f:
            marker = json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return []
    return list(marker.get("parts", [])) if isinstance(marker, dict) else []


def missing_shards(path: str, parts: Sequence[str] = ()) -> list[str]:
    """Files of worker checkpoints in `path` that are not there ("actor/rank1.pt", ...): for each of `parts` and every
    subdirectory that holds a worker checkpoint (a `dcp/` directory or `rank0.pt`)."""
    found = [n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n, "dcp"))]
    found += [n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n, "rank0.pt"))]
    return [f"{part}/{name}" for part in sorted({*parts, *found}) for name in missing_files(os.path.join(path, part))]


def is_complete(path: str) -> bool:
    """Marked COMPLETE, with the trainer state and every rank's shard files of the worker checkpoints."""
    if not (os.path.isfile(os.path.join(path, COMPLETE)) and os.path.isfile(os.path.join(path, STATE_FILE))):
        return False
    missing = missing_shards(path, step_parts(path))
    if missing:
        logger.warning("checkpoint %s is marked complete but lacks %s: skipped", path, ", ".join(missing[:8]))
    return not missing


class CheckpointManager:
    def __init__(self, run_dir: str, max_to_keep: int = 2):
        self.root = os.path.join(run_dir, "checkpoints")
        self.max_to_keep = max_to_keep
        os.makedirs(self.root, exist_ok=True)

    def complete_checkpoints(self) -> list[tuple[int, str]]:
        """(step, path) of every complete checkpoint, oldest first."""
        found = []
        for name in os.listdir(self.root):
            match = _STEP_RE.match(name)
            path = os.path.join(self.root, name)
            if match and is_complete(path):
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self) -> str | None:
        ckpts = self.complete_checkpoints()
        return ckpts[-1][1] if ckpts else None

    def resolve(self, resume: str) -> str | None:
        """`trainer.resume`: 'auto' (newest complete one, or None), 'disable' (None) or an explicit path."""
        if resume == "disable":
            return None
        if resume == "auto":
            return self.latest()
        if not is_complete(resume):
            raise CheckpointError(f"trainer.resume={resume!r} is not a complete checkpoint (no {COMPLETE} marker)")
        return resume

    def sweep_incomplete(self) -> None:
        """Remove temporary directories left by a process killed while writing."""
        for name in os.listdir(self.root):
            if name.startswith(".tmp-"):
                logger.warning("removing incomplete checkpoint %s", name)
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    @contextlib.contextmanager
    def writing(self, step: int, parts: Sequence[str] = ()) -> Iterator[str]:
        """Yield a temporary directory to fill; on success mark it complete and rename it into place. `parts`: the
        worker checkpoints (subdirectories) it must hold, every rank's files of each."""
        final = os.path.join(self.root, step_dir_name(step))
        tmp = os.path.join(self.root, f".tmp-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        try:
            yield tmp
            if not os.path.isfile(os.path.join(tmp, STATE_FILE)):
                raise CheckpointError(f"checkpoint for step {step} has no {STATE_FILE}")
            self._check_shards(step, tmp, parts)
            _write_atomic(os.path.join(tmp, COMPLETE), json.dumps({"parts": list(parts)}) + "\n")
            if os.path.exists(final):  # re-saving the same step (e.g. final save right after a periodic one)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        logger.info("checkpoint saved: %s", final)

    def _check_shards(self, step: int, tmp: str, parts: Sequence[str]) -> None:
        missing = missing_shards(tmp, parts)
        if not missing:
            return
        # the usual cause: each worker wrote to its own host's disk; a later resume would fail on this checkpoint
        run_dir = os.path.dirname(self.root)
        raise IncompleteCheckpointError(
            f"the checkpoint of step {step} lacks worker shards where the driver writes it ({', '.join(missing[:6])}"
            f"{', ...' if len(missing) > 6 else ''}): the workers wrote them elsewhere. trainer.run_dir={run_dir} "
            "must be on a filesystem the driver and every worker host share (NFS, Lustre; not a bucket mount). "
            "The checkpoint was not marked complete."
        )

    def _prune(self) -> None:
        if self.max_to_keep <= 0:
            return
        for _, path in self.complete_checkpoints()[: -self.max_to_keep]:
            shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def write_trainer_state(path: str, state: dict) -> None:
        """Driver-side state: JSON-serialisable dict plus the driver's RNG states."""
        _write_atomic(os.path.join(path, STATE_FILE), json.dumps(state, indent=2, sort_keys=True))
        torch.save(capture_rng(), os.path.join(path, RNG_FILE))

    @staticmethod
    def read_trainer_state(path: str) -> dict:
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        rng_path = os.path.join(path, RNG_FILE)
        if os.path.isfile(rng_path):
            restore_rng(torch.load(rng_path, weights_only=False))
        return state


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
