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
    """Front of whichever group generates: pads the prompts to the group size, unpads and trims the result."""

    def __init__(self, group: RayWorkerGroup, n_workers: int, cfg: RSearchConfig):
        self.group, self.n_workers, self.cfg = group, n_workers, cfg
        self._dead: set[int] = set()  # split workers lost mid-stream (trainer.rollout_mode=streaming)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        return self.submit(prompts).result()

    def submit(self, prompts: DataProto) -> PendingGeneration:
        """Start generating and return at once when the group runs on its own (split placement); a colocated group
        generates before this returns (its processes are the actor's). With a worker lost, the live ones share it."""
        live = self.live_workers()
        padded, _ = pad_dataproto_to_divisor(prompts, len(live))
        # the copies are marked, not counted: a trajectory whose context folds is several rows (rollout/context.py)
        padded.non_tensor_batch[_PAD_COPY] = np.array([i >= len(prompts) for i in range(len(padded))], dtype=object)
        if self._dead:
            chunks = padded.chunk(len(live))
            refs = [self.handle(i).generate_sequences_async.remote(c) for i, c in zip(live, chunks, strict=True)]
            return PendingGeneration(DataProtoFuture(collect_fn=DataProto.concat, futures=refs))
        if hasattr(self.group, "generate_sequences_async"):
            return PendingGeneration(self.group.generate_sequences_async(padded))
        return PendingGeneration(self.group.generate_sequences(padded))

    # ---- the split workers one by one (weight pushes and streams skip a lost worker)
    def handle(self, i: int):
        """Worker `i`'s Ray actor handle."""
        return self.group.workers[i]

    def live_workers(self) -> list[int]:
        return [i for i in range(self.n_workers) if i not in self._dead]

    def mark_dead(self, i: int) -> None:
        self._dead.add(i)

    def load_weights(self, weights_ref, version: int | None) -> None:
        """Every live worker loads the weights `weights_ref` points at as policy `version`."""
        if not self._dead:
            self.group.load_weights(weights_ref, version)
            return
        ray.get([self.handle(i).load_weights.remote(weights_ref, version) for i in self.live_workers()])

    def idle_seconds(self) -> float:
        """The live workers' mean idle seconds since start-up."""
        if not self._dead:
            return float(np.mean(self.group.idle_seconds()))
        return float(np.mean(ray.get([self.handle(i).idle_seconds.remote() for i in self.live_workers()])))


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
