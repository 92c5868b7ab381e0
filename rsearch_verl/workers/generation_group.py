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
from verl.protocol import DataProtoFuture, pad_dataproto_to_divisor
from verl.single_controller.ray import RayWorkerGroup

from rsearch_verl.batch import trim_padding
from rsearch_verl.config import RSearchConfig
from rsearch_verl.workers.metrics import reduce_metrics

_PAD_COPY = "pad_copy"  # rows of the prompts copied to fill the last worker's chunk (dropped from the result)


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
                return PendingGeneration(DataProtoFuture(collect_fn=DataProto.concat, futures=refs)).result()
            except ray.exceptions.RayActorError:
                self._each("policy_version")  # finds and marks the dead one

    def submit(self, prompts: DataProto) -> PendingGeneration:
        """Start generating and return at once when the group runs on its own (split placement); a colocated group
        generates before this returns (its processes are the actor's)."""
        if self._tolerant:
            return PendingGeneration(DataProtoFuture(collect_fn=DataProto.concat, futures=self._scatter(prompts)))
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
    """A batch being generated: `done()` polls, `result()` waits and returns it unpadded, trimmed, metrics reduced."""

    def __init__(self, out):
        self._out = out  # a DataProto, or verl's DataProtoFuture of the workers' chunks

    def done(self) -> bool:
        if isinstance(self._out, DataProto):
            return True
        ready, _ = ray.wait(list(self._out.futures), num_returns=len(self._out.futures), timeout=0)
        return len(ready) == len(self._out.futures)

    def result(self) -> DataProto:
        out = self._out if isinstance(self._out, DataProto) else self._out.get()
        copies = np.array([bool(x) for x in out.non_tensor_batch.pop(_PAD_COPY)], dtype=bool)
        if copies.any():
            out = out.select_idxs(~copies)
        out.meta_info["metrics"] = reduce_metrics(out.meta_info)
        trim_padding(out.batch)
        return out
