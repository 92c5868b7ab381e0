"""FSDP2 plumbing shared by the actor, critic and rollout workers: process group, sharding, optimizer, LR
schedule, gradient clipping, full state-dict gather (checkpoints: sharded_checkpoint.py).

The same code runs on CPU (gloo) and GPU (NCCL); only the backend and device differ. verl's `RayWorkerGroup`
sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT for every worker, so `init_distributed` only reads them.

Usage (inside a worker process):
    device = init_distributed(cfg.trainer.device)
    model = shard_model(load_model(cfg.model, tok, seed=cfg.seed), device)
    optim, sched = build_optimizer(model, cfg.actor.optim, total_steps=cfg.trainer.total_steps)
    ...
"""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
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


def set_base_lr(optim: torch.optim.Optimizer, sched, base_lr: float) -> None:
    """Give `optim` a new base learning rate (the schedule's factor at its current step still applies): the health
    watchdog's rollback lowers the lr this way after loading a checkpoint (which restores the old one)."""
    sched.base_lrs = [base_lr for _ in optim.param_groups]
    for group, factor in zip(optim.param_groups, sched.lr_lambdas, strict=True):
        group["initial_lr"] = base_lr
        group["lr"] = base_lr * factor(sched.last_epoch)
    sched._last_lr = [group["lr"] for group in optim.param_groups]


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


def split_minibatches(n: int, mini: int, micro: int) -> list[list[range]]:
    """Row ranges: a list of mini-batches (one optimizer step each), each a list of micro-batches."""
    if mini <= 0 or micro <= 0 or n % mini or mini % micro:
        raise ValueError(f"{n} local rows cannot be split into mini-batches of {mini} and micro-batches of {micro}")
    return [[range(s, s + micro) for s in range(m, m + mini, micro)] for m in range(0, n, mini)]
