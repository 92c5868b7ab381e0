"""LoRA through peft for the actor and the critic (`model.lora_rank > 0`): adapters on the base model's linear layers,
the base weights frozen, and the conversions the workers need around them.

- `add_lora(model, model_cfg)` wraps a causal LM in a `peft.PeftModel` (adapter B zero-initialised, so the wrapped
  model starts equal to the base). The actor's reference policy is the same model inside `model.disable_adapter()`:
  no second copy. The critic wraps its backbone the same way and keeps its value head fully trainable.
- `merged_state_dict(model, state)` turns the gathered peft state dict into the base model's names with
  W + scaling * B @ A folded in: what the rollout engines (HF, vLLM) load and what the HF export writes.
- `save_adapter(model, state, out_dir)` writes the adapter in peft's own format (`PeftModel.from_pretrained` reads it).

Only peft's `lora.Linear` layers are supported (the default targets are the attention and MLP projections); dropout
is 0 so the actor's training forward and the rollout engine's merged forward describe the same policy.

Usage (inside a worker):
    model = add_lora(model, cfg.model)            # before fsdp.shard_model
    with model.disable_adapter(): ref_lp = ...    # the reference policy
    engine.load_weights(merged_state_dict(model, fsdp.full_state_dict(model)))
"""

from __future__ import annotations

import logging

import torch

from rsearch_verl.workers.fsdp import param_counts

logger = logging.getLogger(__name__)

ADAPTER = "default"  # peft's adapter name; one adapter per model


def lora_enabled(model_cfg) -> bool:
    return model_cfg.lora_rank > 0


def _target_modules(model_cfg):
    targets = list(model_cfg.lora_target_modules)
    return "all-linear" if targets == ["all-linear"] else targets


def add_lora(model: torch.nn.Module, model_cfg) -> torch.nn.Module:
    """Wrap a causal LM in a peft LoRA model (`peft.PeftModelForCausalLM`): only the adapters are trainable."""
    # heavy: peft (transformers, accelerate) only when LoRA is on
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    lora_cfg = LoraConfig(
        r=model_cfg.lora_rank,
        lora_alpha=model_cfg.lora_alpha,
        target_modules=_target_modules(model_cfg),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lora_cfg)
    layers = [(n, m) for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)]
    if not layers:
        raise ValueError(f"model.lora_target_modules={model_cfg.lora_target_modules} matched no module of the model")
    odd = [n for n, m in layers if not isinstance(m, LoraLinear)]
    if odd:
        raise ValueError(f"model.lora_target_modules: only linear layers are supported, got e.g. {odd[0]}")
    if model_cfg.gradient_checkpointing:
        # frozen embeddings: checkpointed blocks need an input that requires grad to backpropagate into the adapters
        peft_model.enable_input_require_grads()
    trainable, total = param_counts(peft_model)
    logger.info(
        "LoRA r=%d on %d layers: %d of %d parameters trainable", model_cfg.lora_rank, len(layers), trainable, total
    )
    return peft_model


def _lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The peft LoRA layers by module name (the names of the full state dict's keys, without the parameter)."""
    # heavy: peft only when LoRA is on
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def base_name(peft_key: str) -> str:
    """The base model's name of a peft parameter:
    `base_model.model.model.layers.0.mlp.up_proj.base_layer.weight` -> `model.layers.0.mlp.up_proj.weight`."""
    key = peft_key.removeprefix("base_model.model.")
    return key.replace(".base_layer.", ".")


def merged_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter folded in (W + scaling * B @ A, as peft's merge computes it).

    `model`: the (possibly sharded) peft model, read only for its layers' scaling; `state`: its full state dict
    (`fsdp.full_state_dict`). Keys come back exactly as the plain transformers model names them."""
    # heavy: peft only when LoRA is on
    from peft.utils.other import transpose

    merged: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" not in key:
            merged[base_name(key)] = value
    for name, layer in _lora_layers(model).items():
        a = state[f"{name}.lora_A.{ADAPTER}.weight"].float()
        b = state[f"{name}.lora_B.{ADAPTER}.weight"].float()
        target = base_name(f"{name}.base_layer.weight")
        weight = merged[target]
        delta = transpose(b @ a, layer.fan_in_fan_out) * layer.scaling[ADAPTER]
        merged[target] = (weight.float() + delta).to(weight.dtype)
    return merged


def save_adapter(model: torch.nn.Module, state: dict[str, torch.Tensor], out_dir: str) -> None:
    """Write the adapter (adapter_config.json + adapter_model.safetensors) from the gathered full state dict."""
    model.save_pretrained(out_dir, state_dict=state)
