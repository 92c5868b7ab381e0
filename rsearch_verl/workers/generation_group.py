"""The driver's front of whichever worker group generates (the colocated actor group, or the split placement's own
generation workers): pads the prompts to the group size, and unpads, trims and reduces the result.

    group = GenerationGroup(workers, workers.world_size, cfg)
    out = group.generate_sequences(prompts)                       # waits
    pending = group.submit(prompts); ...; out = pending.result()  # split: generation runs meanwhile
"""

from __future__ import annotations

import numpy as np
import ray
from verl import DataProto
from verl.protocol import pad_dataproto_to_divisor
from verl.single_controller.base.decorator import dispatch_dp_compute_data_proto
from verl.single_controller.ray import RayWorkerGroup

from rsearch_verl.batch import join_rows, trim_padding
from rsearch_verl.config import RSearchConfig
from rsearch_verl.workers.metrics import reduce_metrics

_PAD_COPY = "pad_copy"  # rows of the prompts copied to fill the last worker's chunk (dropped from the result)


def _chunks_as_returned(worker_group, output: list) -> list:
    """verl's collect step, left to us: the workers' chunks (or their refs) as they came; `join_rows` joins them
    (their widths differ: each is padded to its own widest row)."""
    return list(output)


# the dispatch of a generation method: verl's DP split of the prompts; the chunks are joined by `PendingGeneration`
ROLLOUT_DISPATCH = {"dispatch_fn": dispatch_dp_compute_data_proto, "collect_fn": _chunks_as_returned}


class GenerationGroup:
    """Front of whichever group generates: pads the prompts to the group size, unpads and trims the result.

    `tolerate_loss()` (trainer.rollout_mode=streaming, split placement): every call goes to the workers one by one and
    a worker that died (RayActorError) is marked dead and left out from then on, instead of failing the call; the
    streaming pipeline reads `dead_workers()` to regenerate what the dead one had in flight."""

    def __init__(self, group: RayWorkerGroup, n_workers: int, cfg: RSearchConfig):
        self.group, self.n_workers, self.cfg = group, n_workers, cfg
        self._tolerant = False
        self._dead: set[int] = set()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        if not self._tolerant:
            return self.submit(prompts).result()
        while True:  # a worker that dies meanwhile: the batch again, on the live ones
            refs = self._scatter(prompts)
            try:
                return PendingGeneration(refs).result()
            except ray.exceptions.RayActorError:
                self._each("policy_version")  # finds and marks the dead one

    def submit(self, prompts: DataProto) -> PendingGeneration:
        """Start generating and return at once when the group runs on its own (split placement); a colocated group
        generates before this returns (its processes are the actor's)."""
        if self._tolerant:
            return PendingGeneration(self._scatter(prompts))
        padded = _padded(prompts, self.n_workers)
        if hasattr(self.group, "generate_sequences_async"):
            return PendingGeneration(self.group.generate_sequences_async(padded))
        return PendingGeneration(self.group.generate_sequences(padded))

    def load_weights(self, weights_ref, version: int | None) -> None:
        """Every (live) worker loads the weights `weights_ref` points at as policy `version`."""
        if self._tolerant:
            self._each("load_weights", weights_ref, version)
        else:
            self.group.load_weights(weights_ref, version)

    def idle_seconds(self) -> float:
        """The (live) workers' mean idle seconds since start-up."""
        if self._tolerant:
            return float(np.mean(list(self._each("idle_seconds").values())))
        return float(np.mean(self.group.idle_seconds()))

    # ---- one by one (streaming)
    def tolerate_loss(self) -> None:
        self._tolerant = True

    def handle(self, i: int):
        """Worker `i`'s Ray actor handle."""
        return self.group.workers[i]

    def live_workers(self) -> list[int]:
        return [i for i in range(self.n_workers) if i not in self._dead]

    def dead_workers(self) -> set[int]:
        return set(self._dead)

    def mark_dead(self, i: int) -> None:
        self._dead.add(i)
        if not self.live_workers():
            raise RuntimeError("every rollout worker died")

    def _each(self, method: str, *args) -> dict:
        """`method(*args)` on every live worker: {worker: result}; the dead ones are marked and left out."""
        refs = {i: getattr(self.handle(i), method).remote(*args) for i in self.live_workers()}
        out = {}
        for i, ref in refs.items():
            try:
                out[i] = ray.get(ref)
            except ray.exceptions.RayActorError:
                self.mark_dead(i)
        return out

    def _scatter(self, prompts: DataProto) -> list:
        live = self.live_workers()
        chunks = _padded(prompts, len(live)).chunk(len(live))
        return [self.handle(i).generate_sequences_async.remote(c) for i, c in zip(live, chunks, strict=True)]


def _padded(prompts: DataProto, n_workers: int) -> DataProto:
    padded, _ = pad_dataproto_to_divisor(prompts, n_workers)
    # the copies are marked, not counted: a trajectory whose context folds is several rows (rollout/context.py)
    padded.non_tensor_batch[_PAD_COPY] = np.array([i >= len(prompts) for i in range(len(padded))], dtype=object)
    return padded


class PendingGeneration:
    """A batch being generated: `done()` polls, `result()` waits and returns it unpadded, joined (`join_rows`: the
    one owner of row widths), metrics reduced."""

    def __init__(self, chunks: list):
        self._chunks = chunks  # the workers' chunks: DataProtos (colocated, done) or their Ray refs (split)

    def done(self) -> bool:
        refs = [c for c in self._chunks if isinstance(c, ray.ObjectRef)]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else (refs, [])
        return len(ready) == len(refs)

    def result(self) -> DataProto:
        chunks = [ray.get(c) if isinstance(c, ray.ObjectRef) else c for c in self._chunks]
        out = join_rows(chunks)
        copies = np.array([bool(x) for x in out.non_tensor_batch.pop(_PAD_COPY)], dtype=bool)
        if copies.any():
            out = out.select_idxs(~copies)
            trim_padding(out.batch)
        out.meta_info["metrics"] = reduce_metrics(out.meta_info)
        return out
