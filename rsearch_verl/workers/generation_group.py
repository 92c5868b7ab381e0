"""The driver's front of whichever worker group generates (the colocated actor group, or the split placement's own
generation workers): pads the prompts to the group size, and unpads, trims and reduces the result.

    group = GenerationGroup(workers, workers.world_size, cfg)
    out = group.generate_sequences(prompts)                       # waits
    pending = group.submit(prompts); ...; out = pending.result()  # split: generation runs meanwhile
"""

from __future__ import annotations

from verl import DataProto
from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto
from verl.single_controller.ray import RayWorkerGroup

from rsearch_verl.batch import trim_padding
from rsearch_verl.config import RSearchConfig
from rsearch_verl.workers.metrics import reduce_metrics


class GenerationGroup:
    """Front of whichever group generates: pads the prompts to the group size, unpads and trims the result."""

    def __init__(self, group: RayWorkerGroup, n_workers: int, cfg: RSearchConfig):
        self.group, self.n_workers, self.cfg = group, n_workers, cfg

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        return self.submit(prompts).result()

    def submit(self, prompts: DataProto) -> PendingGeneration:
        """Start generating and return at once when the group runs on its own (split placement); a colocated group
        generates before this returns (its processes are the actor's)."""
        validate = bool(prompts.meta_info.get("validate", False))
        n = self.cfg.rollout.val_n if validate else self.cfg.rollout.n
        padded, pad = pad_dataproto_to_divisor(prompts, self.n_workers)
        if hasattr(self.group, "generate_sequences_async"):
            return PendingGeneration(self.group.generate_sequences_async(padded), pad * n)
        return PendingGeneration(self.group.generate_sequences(padded), pad * n)


class PendingGeneration:
    """A batch being generated: `done()` polls, `result()` waits and returns it unpadded, trimmed, metrics reduced."""

    def __init__(self, out, pad: int):
        self._out, self._pad = out, pad  # a DataProto, or verl's DataProtoFuture of the workers' chunks

    def done(self) -> bool:
        import ray

        if isinstance(self._out, DataProto):
            return True
        ready, _ = ray.wait(list(self._out.futures), num_returns=len(self._out.futures), timeout=0)
        return len(ready) == len(self._out.futures)

    def result(self) -> DataProto:
        out = self._out if isinstance(self._out, DataProto) else self._out.get()
        out = unpad_dataproto(out, self._pad)
        out.meta_info["metrics"] = reduce_metrics(out.meta_info)
        trim_padding(out.batch)
        return out
