"""FSDP2 plumbing shared by the actor, critic and rollout workers: process group, sharding with mixed precision,
optimizer, LR schedule, gradient clipping, full state-dict gather (checkpoints: sharded_checkpoint.py).

The same code runs on CPU (gloo) and GPU (NCCL); only the backend and device differ. verl's `RayWorkerGroup`
sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT for every worker, so `init_distributed` only reads them.

Mixed precision as verl's FSDP2 engine does it (docs/architecture.md): the sharded parameters and the AdamW state
are float32 masters; `model.dtype` is only the compute dtype FSDP casts the gathered parameters to for forward and
backward; gradients are reduced in float32. A bfloat16 master would swallow small updates (lr 1e-6 x Adam's unit
step is far below bf16's spacing of ~1e-4 at |w| ~ 0.02).

Usage (inside a worker process):
    device = init_distributed(cfg.trainer.device, cfg.trainer.nccl_timeout_s)
    model = shard_model(load_model(cfg.model, tok, seed=cfg.seed, dtype=MASTER_DTYPE), device, compute_dtype(cfg.model))
    optim, sched = build_optimizer(model, cfg.actor.optim, total_steps=cfg.trainer.total_steps)
    ...
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket

import psutil
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)


MASTER_DTYPE = torch.float32  # what training models (actor, reference, critic) hold and AdamW updates


def compute_dtype(model_cfg) -> torch.dtype:
    """`model.dtype` as a torch dtype: the forward / backward dtype of training models, the rollout engine's dtype."""
    return getattr(torch, model_cfg.dtype)


def local_device(device: str) -> torch.device:
    """This process's device: the CPU, or its accelerator the way verl's workers find it. Ray narrows
    CUDA_VISIBLE_DEVICES to the worker's own GPU (index 0 is then the only one); where it does not (verl's
    RAY_EXPERIMENTAL_NOSET_*_VISIBLE_DEVICES, or torchrun), LOCAL_RANK names the device."""
    if device == "cpu":
        return torch.device("cpu")
    # heavy: verl (and Ray with it) kept out of fsdp, which the toy warm start imports
    from verl.utils.device import get_device_name, get_torch_device

    name, module = get_device_name(), get_torch_device()
    count = module.device_count()
    if count == 0:
        raise RuntimeError(
            f"trainer.device={device}: this process sees no accelerator (CUDA_VISIBLE_DEVICES is empty?)"
        )
    index = 0 if count == 1 else int(os.environ.get("LOCAL_RANK", "0"))
    if index >= count:
        raise RuntimeError(f"LOCAL_RANK={index} but this process sees only {count} {name} devices")
    module.set_device(index)
    return torch.device(name, index)


def pin_gloo_interface(master_addr: str) -> None:
    """Gloo announces the address its host name resolves to, which is often a loopback one (/etc/hosts mapping the
    host name to 127.0.0.1 or 127.0.1.1): ranks on other hosts then dial their own loopback and the rendezvous times
    out. Unless GLOO_SOCKET_IFNAME says otherwise, use the interface that routes to the rendezvous address."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or master_addr in ("127.0.0.1", "localhost", "::1"):
        return

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # UDP connect: picks the route, sends nothing
        sock.connect((master_addr, 9))
        local = sock.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == local for a in addrs) and not local.startswith("127."):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            logger.info("gloo on %s (%s): the route to MASTER_ADDR=%s", name, local, master_addr)
            return


def init_distributed(device: str, timeout_s: float = 1800.0) -> torch.device:
    """Join the worker group's process group once (gloo on CPU; on an accelerator verl's pair: gloo for CPU tensors,
    NCCL for device tensors) with an explicit collective timeout; return this rank's device."""
    dev = local_device(device)
    if not dist.is_initialized():
        if device == "cpu":
            backend = "gloo"
        else:
            # heavy: verl (and Ray with it) kept out of fsdp, which the toy warm start imports
            from verl.utils.device import get_nccl_backend

            backend = f"cpu:gloo,{dev.type}:{get_nccl_backend()}"
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        pin_gloo_interface(os.environ["MASTER_ADDR"])
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
        logger.info("process group %s rank %d/%d on %s (timeout %.0f s)", backend, rank, world, dev, timeout_s)
    return dev


def mixed_precision(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """verl's FSDP2 policy: gather parameters in `dtype`, reduce gradients in float32, cast floating inputs. For a
    float32 compute dtype there is nothing to cast (and no second copy of the parameters)."""
    if dtype == MASTER_DTYPE:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)


def shard_model(
    model: torch.nn.Module, device: torch.device, dtype: torch.dtype = MASTER_DTYPE, trainable: bool = True
) -> torch.nn.Module:
    """FSDP2: one `fully_shard` unit per decoder layer, then the root (embeddings, norm, tied head, value head).
    `dtype` is the compute dtype. A trainable model's parameters become float32 masters whatever they were loaded
    in; a forward-only one (the reference policy) is stored in the compute dtype, as verl keeps it: with no update
    there is nothing for fp32 to preserve, and it halves that model's memory."""
    model = model.to(device=device, dtype=MASTER_DTYPE if trainable else dtype)
    policy = mixed_precision(dtype)
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP units below the root: every module whose class transformers names in `_no_split_modules` (the
    decoder layer classes, as verl's FSDP2 wrap policy reads them: Qwen2DecoderLayer, LlamaDecoderLayer,
    Qwen3_5DecoderLayer whose token mixer is a Gated DeltaNet or a gated attention, Qwen3_5MoeDecoderLayer with its
    sparse MoE block inside), wherever wrappers (peft, the value model) put the model, outermost only. A model that
    names none: the first `layers` ModuleList. MoE: the routed experts are two fused 3-D parameters per layer
    ([experts, 2 x width, hidden] and [experts, hidden, width]); FSDP2 shards them on dim 0 (experts, padded when
    the world size does not divide them) and all-gathers every expert with the layer (docs/gpu.md)."""
    names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(outer + ".") for outer, _ in found)
        if name and type(module).__name__ in names and not inside:
            found.append((name, module))
    if found:
        return [module for _, module in found]
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, torch.nn.ModuleList):
            return list(module)
    return []


def full_state_dict(model: torch.nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Gather the full (unsharded) parameters on CPU (the float32 masters). Collective: every rank must call it.
    `rank0_only`: only rank 0 receives them (torch DCP's cpu_offload gathers parameter by parameter to rank 0's host
    memory); the others get {} and never hold a full copy (checkpoint export, split placement's weight sync)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    sd = get_model_state_dict(model, options=options)
    return {k: v.detach().cpu() for k, v in sd.items()}


def cast_floating(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` with its floating tensors in `dtype`, in place (each master is freed as its copy is made), so an
    engine or an export gets the compute dtype without holding both copies of the whole model."""
    for key, value in state.items():
        if value.is_floating_point() and value.dtype != dtype:
            state[key] = value.to(dtype)
    return state


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
