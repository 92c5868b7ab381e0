"""The process's random number generator state (Python, NumPy, torch CPU and CUDA): capture and restore.

One owner for what a checkpoint must carry to continue the same random streams, used by the driver
(trainer/checkpoint.py) and by every worker (workers/sharded_checkpoint.py).

    state = capture_rng()       # picklable dict
    restore_rng(state)
"""

from __future__ import annotations

import random

import numpy as np
import torch


def capture_rng() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
