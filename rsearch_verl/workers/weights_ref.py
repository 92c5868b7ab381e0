"""The handle a split-placement weight sync moves: actor rank 0 `ray.put`s its gathered weights itself and returns this
small record, which the driver hands to every rollout worker (rsearch_verl/workers/weight_sync.py), so the state dict
never travels through the driver and exactly one copy enters the object store."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class WeightsRef:
    """Actor rank 0's gathered weights, put in the object store by rank 0 itself: the one copy a weight sync moves."""

    ref: Any  # ray.ObjectRef of dict[str, torch.Tensor] (base model names, LoRA merged)
    nbytes: int  # sum of numel x element_size over the tensors
    n_tensors: int
