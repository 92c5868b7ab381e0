"""FSDP2 plumbing shared by the actor, critic and rollout workers: process group, sharding, optimizer, LR
schedule, gradient clipping, full state-dict gather, RNG state and per-rank checkpoints.

The same code runs on CPU (gloo) and GPU (NCCL); only the backend and device differ. verl's `RayWorkerGroup`
sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT for every worker, so `init_distributed` only reads them.

Usage (inside a worker process):
    device = init_distributed(cfg.trainer.device)
    model = shard_model(load_model(cfg.model, tok, seed=cfg.seed), device)
    optim, sched = build_optimizer(model, cfg.actor.optim, total_steps=cfg.trainer.total_steps)
    ...
    save_checkpoint(dir, model, optim, sched)      # every rank writes its own shard
"""

from __future__ import annotations

import logging
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)


def init_distributed(device: str) -> torch.device:
    """Join the worker group's process group (gloo on CPU, NCCL on CUDA) once; return this rank's device."""
    if device == "cuda":
        # Ray gives each worker one visible GPU, so the local device is always index 0
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
        logger.info("process group %s rank %d/%d", backend, rank, world)
    return dev


def shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP2: one `fully_shard` unit per decoder layer, then the root (embeddings, norm, tied head, value head)."""
    model = model.to(device)
    for layer in _decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks: the first `layers` ModuleList, wherever wrappers (peft, the value model) put it."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, torch.nn.ModuleList):
            return list(module)
    return []


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gather the full (unsharded) parameters on every rank, on CPU. Collective: every rank must call it."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu() for k, v in sd.items()}


def _lr_lambda(warmup: int, total: int, kind: str, min_ratio: float):
    def fn(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if kind == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


def build_optimizer(model: torch.nn.Module, optim_cfg, total_steps: int):
    """AdamW over the trainable parameters (all of them, or LoRA's adapters) + LambdaLR (linear warmup, then constant
    or cosine to `min_lr_ratio`), stepped once per update."""
    if optim_cfg.lr_scheduler not in ("constant", "cosine"):
        raise ValueError(f"optim.lr_scheduler: {optim_cfg.lr_scheduler!r} is not one of ['constant', 'cosine']")
    params = [p for p in model.parameters() if p.requires_grad]
    betas = tuple(optim_cfg.betas)
    optim = torch.optim.AdamW(params, lr=optim_cfg.lr, betas=betas, weight_decay=optim_cfg.weight_decay)
    fn = _lr_lambda(optim_cfg.warmup_steps, total_steps, optim_cfg.lr_scheduler, optim_cfg.min_lr_ratio)
    return optim, torch.optim.lr_scheduler.LambdaLR(optim, fn)


def clip_grad(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (over all shards); return the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm if max_norm > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def param_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; DTensor parameters count with their global size."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def optimizer_state_bytes(optim: torch.optim.Optimizer, device: torch.device) -> int:
    """Bytes of optimizer state (Adam moments, step counters) over all ranks. Collective."""
    local = 0
    for state in optim.state.values():
        for value in state.values():
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor):
                local += value.numel() * value.element_size()
    return int(all_reduce_sum(local, device))


def param_metrics(model: torch.nn.Module, optim: torch.optim.Optimizer, device: torch.device, role: str) -> dict:
    """`<role>/trainable_params`, `<role>/total_params`, `<role>/optim_state_bytes` (global). Collective."""
    trainable, total = param_counts(model)
    return {
        f"{role}/trainable_params": float(trainable),
        f"{role}/total_params": float(total),
        f"{role}/optim_state_bytes": float(optimizer_state_bytes(optim, device)),
    }


def all_reduce_mean(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Average a dict of floats over ranks (every rank must pass the same keys in the same order)."""
    if not values or not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist(), strict=True))


def all_reduce_sum(value: float, device: torch.device) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return float(t.item())


def get_rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_local(obj):
    """Replace every DTensor in a nested state dict by its local shard (plain tensors pickle portably)."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_local(v) for v in obj)
    return obj


def _from_local(template, saved):
    """Rebuild DTensors shaped like `template` from the local shards in `saved`."""
    if isinstance(template, DTensor):
        local = saved.to(template.to_local().device)
        return DTensor.from_local(
            local, template.device_mesh, template.placements, shape=template.shape, stride=template.stride()
        )
    if isinstance(template, dict):
        return {k: _from_local(template[k], saved[k]) if k in template else saved[k] for k in saved}
    if isinstance(saved, torch.Tensor) and isinstance(template, torch.Tensor):
        return saved.to(template.device)
    return saved


def _shard_path(ckpt_dir: str) -> str:
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return os.path.join(ckpt_dir, f"shard_rank{rank}_of{world}.pt")


def _frozen(model) -> set[str]:
    """Names of the frozen parameters (LoRA's base weights): rebuilt from `model.path` on load, never saved."""
    # every name of a tied parameter (a tied LM head) is a state-dict key of its own
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def save_checkpoint(ckpt_dir: str, model, optim=None, sched=None, extra: dict | None = None) -> str:
    """Every rank writes its model/optimizer shards, LR scheduler and RNG state to `ckpt_dir`. Frozen parameters
    (LoRA's base model) are left out: the model shard then holds the adapters (and a value head) only."""
    os.makedirs(ckpt_dir, exist_ok=True)
    if optim is not None:
        model_sd, optim_sd = get_state_dict(model, optim)
    else:
        model_sd, optim_sd = get_model_state_dict(model), None
    frozen = _frozen(model)
    model_sd = {k: v for k, v in model_sd.items() if k not in frozen}
    state = {
        "model": _to_local(model_sd),
        "optim": _to_local(optim_sd) if optim_sd is not None else None,
        "sched": sched.state_dict() if sched is not None else None,
        "rng": get_rng_state(),
        "extra": extra or {},
    }
    path = _shard_path(ckpt_dir)
    torch.save(state, path)
    if dist.is_initialized():
        dist.barrier()
    return path


def load_checkpoint(ckpt_dir: str, model, optim=None, sched=None) -> dict:
    """Inverse of `save_checkpoint` (same world size); returns the saved `extra` dict."""
    path = _shard_path(ckpt_dir)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint shard {path} (was it written with a different world size?)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    frozen = _frozen(model)
    template = get_model_state_dict(model)
    expected = set(template) - frozen
    if set(state["model"]) != expected:
        diff = sorted(set(state["model"]) ^ expected)
        raise ValueError(f"checkpoint {path} does not fit this model (model.lora_rank changed?): e.g. {diff[:3]}")
    if optim is not None:
        # get_state_dict initialises empty optimizer state, so the templates hold every DTensor we need
        model_t, optim_t = get_state_dict(model, optim)
        set_state_dict(
            model,
            optim,
            model_state_dict=_from_local(model_t, state["model"]),
            optim_state_dict=_from_local(optim_t, state["optim"]),
            options=StateDictOptions(strict=not frozen),
        )
    else:
        model.load_state_dict(_from_local(template, state["model"]), strict=not frozen)
    if sched is not None and state["sched"] is not None:
        sched.load_state_dict(state["sched"])
    set_rng_state(state["rng"])
    return state["extra"]


def split_minibatches(n: int, mini: int, micro: int) -> list[list[range]]:
    """Row ranges: a list of mini-batches (one optimizer step each), each a list of micro-batches."""
    if mini <= 0 or micro <= 0 or n % mini or mini % micro:
        raise ValueError(f"{n} local rows cannot be split into mini-batches of {mini} and micro-batches of {micro}")
    return [[range(s, s + micro) for s in range(m, m + mini, micro)] for m in range(0, n, mini)]
