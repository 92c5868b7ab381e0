"""Reshardable worker checkpoints: model and optimizer through torch.distributed.checkpoint (DCP).

DCP stores every parameter and optimizer state with its global shape and the slice each rank held, so a checkpoint
written by N FSDP ranks loads on M ranks (1 -> 2 workers, 8 -> 16 GPUs): each rank reads the slices its new shard
needs. Beside it each rank writes a small `rank<r>.pt` with its LR-scheduler state and RNG state. The checkpoint
directory itself is made atomic by the driver (trainer/checkpoint.py writes into a temporary directory and renames).

    <ckpt_dir>/dcp/          DCP files (.metadata + one data file per writing rank)
    <ckpt_dir>/rank<r>.pt    {"sched", "rng", "extra", "world_size"} of rank r

Usage (inside a worker, every rank calls both; they are collective):
    save_checkpoint(ckpt_dir, model, optim, sched)
    extra = load_checkpoint(ckpt_dir, model, optim, sched)

The driver checks that every rank's files arrived before it marks a checkpoint complete (they do not when
`trainer.run_dir` is not shared between hosts: each rank writes on its own host's disk):
    missing_files(ckpt_dir)    # [] or e.g. ["rank1.pt", "dcp/__1_0.distcp"]
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from rsearch_verl.rng import capture_rng, restore_rng

logger = logging.getLogger(__name__)

DCP_DIR = "dcp"


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _frozen(model) -> set[str]:
    """Names of the frozen parameters (LoRA's base weights): rebuilt from `model.path` on load, never saved."""
    # every name of a tied parameter (a tied LM head) is a state-dict key of its own
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _state(model, optim) -> dict:
    """The DCP state dict: the model's trainable (and optimizer's) sharded tensors, keyed by fully qualified name.
    With LoRA the model part holds the adapters (and a value head) only."""
    frozen = _frozen(model)
    if optim is None:
        model_sd, optim_sd = get_model_state_dict(model), None
    else:  # get_state_dict also initialises an optimizer that has not stepped yet, so loading has a full template
        model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": {k: v for k, v in model_sd.items() if k not in frozen}}
    if optim_sd is not None:
        state["optim"] = optim_sd
    return state


def save_checkpoint(ckpt_dir: str, model, optim=None, sched=None, extra: dict | None = None) -> str:
    """Write the model/optimizer (DCP, reshardable) and this rank's scheduler + RNG state into `ckpt_dir`."""
    rank, world = _rank_world()
    os.makedirs(ckpt_dir, exist_ok=True)
    dcp.save(_state(model, optim), checkpoint_id=os.path.join(ckpt_dir, DCP_DIR))
    local = {
        "sched": sched.state_dict() if sched is not None else None,
        "rng": capture_rng(),
        "extra": extra or {},
        "world_size": world,
    }
    torch.save(local, os.path.join(ckpt_dir, f"rank{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()
    return ckpt_dir


def load_checkpoint(ckpt_dir: str, model, optim=None, sched=None) -> dict:
    """Inverse of `save_checkpoint`, at any world size; returns the saved `extra` dict.

    A rank that did not exist when the checkpoint was written takes rank 0's scheduler state (the same on every
    rank) and keeps its own RNG state (seeded at start-up), with a warning."""
    path = os.path.join(ckpt_dir, DCP_DIR)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"no DCP checkpoint in {path}")
    state = _state(model, optim)
    try:
        dcp.load(state, checkpoint_id=path)  # in place, each rank reading the slices of its own shards
    except RuntimeError as exc:
        raise ValueError(f"checkpoint {path} does not fit this model (model.lora_rank changed?): {exc}") from exc
    options = StateDictOptions(strict=not _frozen(model))
    if optim is None:
        set_model_state_dict(model, state["model"], options=options)
    else:
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    rank, world = _rank_world()
    own = os.path.join(ckpt_dir, f"rank{rank}.pt")
    local = torch.load(own if os.path.isfile(own) else os.path.join(ckpt_dir, "rank0.pt"), weights_only=False)
    if sched is not None and local["sched"] is not None:
        sched.load_state_dict(local["sched"])
    if local["world_size"] != world:
        logger.warning("checkpoint written by %d ranks, loaded by %d: resharded", local["world_size"], world)
    if os.path.isfile(own):
        restore_rng(local["rng"])
    return local["extra"]


def missing_files(ckpt_dir: str) -> list[str]:
    """The files of a `save_checkpoint` directory that are not there, relative to it: the DCP metadata, every data
    file it names (one per writing rank), and `rank<r>.pt` for each of the `world_size` ranks rank 0 recorded."""
    if not os.path.isdir(ckpt_dir):
        return ["(the directory)"]
    missing = []
    path = os.path.join(ckpt_dir, DCP_DIR)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        missing.append(f"{DCP_DIR}/.metadata")
    else:
        storage = dcp.FileSystemReader(path).read_metadata().storage_data or {}
        files = sorted({info.relative_path for info in storage.values()})
        missing += [f"{DCP_DIR}/{name}" for name in files if not os.path.isfile(os.path.join(path, name))]
    rank0 = os.path.join(ckpt_dir, "rank0.pt")
    if not os.path.isfile(rank0):
        return [*missing, "rank0.pt"]
    world = int(torch.load(rank0, weights_only=False)["world_size"])
    missing += [f"rank{r}.pt" for r in range(1, world) if not os.path.isfile(os.path.join(ckpt_dir, f"rank{r}.pt"))]
    return missing
