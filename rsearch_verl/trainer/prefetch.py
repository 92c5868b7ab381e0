"""Log-probs a streaming step computes while it waits (`trainer.prefetch_log_probs`, docs/async_training.md).

A streaming step (rsearch_verl/trainer/stream_pipeline.py) often waits for a due long group while the groups it will
train have finished. The actor is idle then, and two of the step's phases need nothing that changes before the update:
the reference log-probs (the frozen reference: valid for a group whatever step trains it) and the proximal log-probs
(the actor's current weights, version step-1: valid only if that step trains the group). `LogProbPrefetch` computes
them for the next finished group per wait (or the next few, so that the rows split evenly over the workers), in
admission order, and records with which version. When the step's batch is taken, each admitted group's rows carry a
flag per tensor (`PREFETCHED_OLD`, `PREFETCHED_REF`: 1-D, so they survive `join_rows` and `fit_rows`); the loop's
phases compute only the rows without it (`fill_log_probs`). With `check`, the loop recomputes every row as well and
fails the run if a prefetched value differs by more than `CHECK_TOL` (tests/e2e/test_e2e_streaming.py).

    prefetch = LogProbPrefetch(compute, with_ref=cfg.use_ref, world_size=cfg.world_size)
    prefetch.one(groups, version)              # in the wait: True if groups were computed
    prefetch.mark(admitted, version)            # before the batch is concatenated
    batch, n = fill_log_probs(batch, "old_log_probs", PREFETCHED_OLD, wg.actor.compute_log_prob, 1, check=False)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from verl import DataProto

from rsearch_verl.batch import join_rows

PREFETCHED_OLD = "prefetched_old"
PREFETCHED_REF = "prefetched_ref"
CHECK_TOL = 1e-4  # nats: a prefetched log-prob against the step's own (float32 differs ~1e-6 with the batch's shape)


class LogProbPrefetch:
    def __init__(self, compute: Callable[[DataProto, bool, bool], DataProto], with_ref: bool, world_size: int):
        self.compute = compute  # (batch, old, ref) -> DataProto with old_log_probs and / or ref_log_prob
        self.with_ref, self.world_size = with_ref, world_size
        self._old: dict[int, int] = {}  # seq -> the actor version its proximal log-probs were computed with
        self._ref: set[int] = set()  # seqs whose reference log-probs are computed
        self.seconds = 0.0  # actor time spent here since the last `mark` (the loop counts it as actor work)

    def one(self, groups: list[tuple[int, DataProto]], version: int) -> bool:
        """Compute what the first of `groups` (seq, batch; admission order) lack at `version`: as few groups as make
        a multiple of the workers' count of rows (a DP call splits them evenly; one group on one worker). True if
        any was computed."""
        todo, rows = [], 0
        for seq, batch in groups:
            if self._old.get(seq) != version or (self.with_ref and seq not in self._ref):
                todo.append((seq, batch))
                rows += len(batch)
                if rows % self.world_size == 0:
                    break
        if not todo or rows % self.world_size:
            return False
        start = time.perf_counter()
        old = any(self._old.get(seq) != version for seq, _ in todo)
        ref = self.with_ref and any(seq not in self._ref for seq, _ in todo)
        # a new batch of shallow copies (join_rows pads what it joins), cut back to each group's own width below
        view = join_rows([DataProto(batch=b.batch.copy(), non_tensor_batch=b.non_tensor_batch) for _, b in todo])
        out = self.compute(view, old, ref)
        first = 0
        for seq, batch in todo:
            width = batch.batch["responses"].shape[1]  # each group is padded to its own widest row
            for key in list(out.batch.keys()):
                value = out.batch[key][first : first + len(batch), :width]
                batch.batch[key] = torch.nn.functional.pad(value, (0, width - value.shape[1]))
            first += len(batch)
            if old:
                self._old[seq] = version
            if ref:
                self._ref.add(seq)
        self.seconds += time.perf_counter() - start
        return True

    def mark(self, groups: list[tuple[int, DataProto]], version: int) -> dict[str, float]:
        """Flag each admitted group's rows: proximal log-probs computed at `version`, reference log-probs computed;
        zeros (flag off) where not, so every group has the same keys. Returns the step's prefetch metrics."""
        rows = {"old": 0, "ref": 0, "all": 0}
        for seq, batch in groups:
            n, width = len(batch), batch.batch["responses"].shape[1]
            fresh = {"old": self._old.pop(seq, None) == version, "ref": seq in self._ref}
            self._ref.discard(seq)
            for kind, key, flag in (("old", "old_log_probs", PREFETCHED_OLD), ("ref", "ref_log_prob", PREFETCHED_REF)):
                if kind == "ref" and not self.with_ref:
                    continue
                if not fresh[kind]:
                    batch.batch[key] = torch.zeros(n, width)
                batch.batch[flag] = torch.full((n,), fresh[kind])
                rows[kind] += n * fresh[kind]
            rows["all"] += n
        seconds, self.seconds = self.seconds, 0.0
        total = max(1, rows["all"])
        return {"stream/prefetched_old_frac": rows["old"] / total, "stream/prefetched_ref_frac": rows["ref"] / total,
                "timing/prefetch_s": seconds}  # fmt: skip

    def forget(self) -> None:
        """Everything not yet trained is gone (rollback, resume)."""
        self._old.clear(), self._ref.clear()


def fill_log_probs(batch: DataProto, key: str, flag: str, compute: Callable[[DataProto], DataProto], world_size: int,
                   check: bool) -> tuple[DataProto, int]:  # fmt: skip
    """`batch.batch[key]` for every row: computed by `compute` for the rows without `flag` (all rows when there is no
    flag, or when the missing rows do not split over the `world_size` workers of the DP call); with `check` for every
    row, and a prefetched value that differs raises. Pops the flag; returns the batch and the rows computed."""
    have = batch.batch.pop(flag) if flag in list(batch.batch.keys()) else None
    if have is None:
        return batch.union(compute(batch)), len(batch)
    have = have.bool()
    missing = torch.nonzero(~have).flatten()
    if check or len(missing) % world_size:
        fresh = compute(batch).batch[key]
        if check and have.any():
            diff = (fresh[have] - batch.batch[key][have]).abs() * batch.batch["response_mask"][have]
            if float(diff.max()) > CHECK_TOL:
                raise RuntimeError(f"prefetched {key} differ from the step's by {float(diff.max()):.2e} nats")
        batch.batch[key] = fresh
        return batch, len(batch)
    if len(missing):
        batch.batch[key][missing] = compute(batch.select_idxs(missing.numpy())).batch[key]
    return batch, len(missing)
