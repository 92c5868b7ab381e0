"""The actor worker: the FSDP2-sharded policy, its frozen reference copy and (colocated placement) the rollout
engine, in one process per device — verl's "hybrid" layout on our own worker built on `verl.single_controller`.

With LoRA (`model.lora_rank > 0`, rsearch_verl/workers/lora.py) the policy is a peft model whose base is frozen; the
reference is the same model with its adapters disabled (no copy); engines and the HF export get merged weights under
the base model's names; checkpoints hold the adapters and their optimizer state. Packing and token-budget
micro-batches (`actor.use_remove_padding`, `actor.use_dynamic_bsz`): rsearch_verl/workers/packing.py.

Methods (called by the driver through a `RayWorkerGroup`; DP_COMPUTE_PROTO splits the batch over ranks):
    init_model()                       build, shard, optimizer + LR schedule; the rollout engine when colocated
    compute_log_prob(batch)            -> old_log_probs [B, R]
    compute_ref_log_prob(batch)        -> ref_log_prob [B, R]
    update_actor(batch)                PPO epochs over mini-batches (each token's loss weighed by `is_weights` when the
                                       batch has them); meta_info["metrics"] (actor/*)
    generate_sequences(prompts)        the search-aware rollout on this rank's prompts (colocated only)
    sync_rollout_weights(version)      weights streamed (bucketed) into this process's engine as `version` (colocated)
    full_state_dict(as_ref)            the gathered weights, rank 0 only (split: a ref rank 0 put in the object store)
    save_checkpoint(dir) / load_checkpoint(dir)   reshardable (DCP) model + optimizer, scheduler, RNG; dir/hf export
    set_lr_scale(scale)                lr = actor.optim.lr x scale from now on (the health watchdog's rollback)

Every loss reads the batch's `loss_mask` (written once by the driver, rsearch_verl/batch.py): with masking on,
observation tokens carry no loss and no gradient.
"""

from __future__ import annotations

import copy
import logging
import os

import ray
import torch
from torch.distributed.tensor import DTensor
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.model import convert_weight_keys

from rsearch_verl import signals as sig
from rsearch_verl.algos.losses import agg_loss, kl_loss, policy_loss
from rsearch_verl.config import from_omegaconf
from rsearch_verl.log_setup import quiet_expected_warnings
from rsearch_verl.models import load_model, policy_tokenizer
from rsearch_verl.workers import fsdp, lora, sharded_checkpoint
from rsearch_verl.workers.forward import (
    check_remove_padding,
    global_denominator,
    mean_metrics,
    response_log_probs,
    world_size,
)
from rsearch_verl.workers.generation import GenerationRunner
from rsearch_verl.workers.generation_group import ROLLOUT_DISPATCH
from rsearch_verl.workers.packing import micro_batches, restore_order
from rsearch_verl.workers.varlen_attention import configure_attention
from rsearch_verl.workers.weights_ref import WeightsRef

logger = logging.getLogger(__name__)


class ActorWorker(Worker):
    def __init__(self, cfg_dict: dict, with_rollout: bool = True):
        quiet_expected_warnings(cpu=cfg_dict["trainer"]["device"] == "cpu")  # before verl looks for a GPU
        super().__init__()
        self.cfg = from_omegaconf(cfg_dict)
        self.with_rollout = with_rollout
        self.rollout: GenerationRunner | None = None
        self.ref = None
        self.use_lora = False

    # ------------------------------------------------------------------ setup
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        cfg = self.cfg
        self.device = fsdp.init_distributed(cfg.trainer.device, cfg.trainer.nccl_timeout_s)
        self.dtype = fsdp.compute_dtype(cfg.model)
        torch.manual_seed(cfg.seed)
        self.tokenizer = policy_tokenizer(cfg)
        # float32 masters (workers/fsdp.py), seeded: every rank starts from the same weights
        model = load_model(cfg.model, self.tokenizer, seed=cfg.seed, dtype=fsdp.MASTER_DTYPE)
        if self.with_rollout:  # the engine copies the plain base model in the compute dtype (LoRA reaches it merged)
            engine_model = copy.deepcopy(model).to(self.dtype)
            self.rollout = GenerationRunner(cfg, engine_model, self.tokenizer, self.device)
            del engine_model  # the runner holds its own copy
        configure_attention(model, cfg.model, cfg.actor.use_remove_padding)
        self.use_lora = lora.lora_enabled(cfg.model)
        if self.use_lora:  # the reference is this model with its adapters disabled: no copy
            model = lora.add_lora(model, cfg.model)
        elif cfg.use_ref:
            ref = copy.deepcopy(model).eval()
            ref.requires_grad_(False)
            self.ref = fsdp.shard_model(ref, self.device, self.dtype, trainable=False)
        self.model = fsdp.shard_model(model, self.device, self.dtype)
        self.optim, self.sched = fsdp.build_optimizer(self.model, cfg.actor.optim, total_steps=cfg.trainer.total_steps)
        if cfg.actor.use_remove_padding:
            check_remove_padding(self.model, self.device, len(self.tokenizer), dtype=self.dtype)

    # ------------------------------------------------------------------ forward passes
    def _micro_batches(self, data: DataProto) -> tuple[list[DataProto], list[int] | None]:
        cfg = self.cfg.actor
        budget = cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
        return micro_batches(data, cfg.micro_batch_size, budget, self.device)

    @torch.no_grad()
    def _log_probs(self, model, data: DataProto) -> torch.Tensor:
        model.eval()
        micros, order = self._micro_batches(data)
        rmpad, chunk = self.cfg.actor.use_remove_padding, self.cfg.actor.logprob_chunk_size
        out = [
            response_log_probs(model, m, self.device, remove_padding=rmpad, chunk_size=chunk)[0].cpu() for m in micros
        ]
        return restore_order(torch.cat(out), order)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={"old_log_probs": self._log_probs(self.model, data)})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        if self.use_lora:
            with self.model.disable_adapter():  # peft: the frozen base model, i.e. the reference policy
                return DataProto.from_dict(tensors={"ref_log_prob": self._log_probs(self.model, data)})
        if self.ref is None:
            raise RuntimeError("compute_ref_log_prob: no reference model (neither KL in reward nor KL loss is on)")
        return DataProto.from_dict(tensors={"ref_log_prob": self._log_probs(self.ref, data)})

    # ------------------------------------------------------------------ update
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        cfg = self.cfg.actor
        kl_coef = float(data.meta_info.get("kl_coef", 0.0))
        # folded trajectories (more rows than trajectories): the driver says how many optimizer steps an epoch makes
        steps = data.meta_info.get("mini_batches", {}).get("actor")
        mini = cfg.ppo_mini_batch_size // world_size() if steps is None else -(-len(data) // steps)
        self.model.train()
        rows = []
        for _ in range(cfg.ppo_epochs):
            for start in range(0, len(data), mini):
                rows.append(self._optimizer_step(data[start : start + mini], kl_coef))
        self.sched.step()
        metrics = fsdp.all_reduce_mean(mean_metrics(rows), self.device)
        metrics["actor/lr"] = self.sched.get_last_lr()[0]
        metrics.update(fsdp.param_metrics(self.model, self.optim, self.device, "actor"))
        return DataProto(meta_info={"metrics": metrics})

    def _optimizer_step(self, minibatch: DataProto, kl_coef: float) -> dict[str, float]:
        """One optimizer step over a mini-batch, micro-batch by micro-batch; returns the step's metrics."""
        cfg = self.cfg.actor
        mode, scale = cfg.loss_agg_mode, self.cfg.loss_scale_factor
        # the global denominator makes the sum of micro-batch losses over all ranks the mini-batch loss
        denom = global_denominator(minibatch.batch["loss_mask"], mode, self.device)
        self.optim.zero_grad(set_to_none=True)
        parts = []
        for micro in self._micro_batches(minibatch)[0]:
            t = {k: v.to(self.device) for k, v in micro.batch.items()}
            mask = t["loss_mask"]
            log_prob, entropy = response_log_probs(
                self.model,
                micro,
                self.device,
                with_entropy=cfg.entropy_coeff != 0,
                remove_padding=cfg.use_remove_padding,
                chunk_size=cfg.logprob_chunk_size,
            )
            loss, m = policy_loss(
                old_log_prob=t["old_log_probs"],
                log_prob=log_prob,
                advantages=t["advantages"],
                response_mask=mask,
                clip_ratio_low=cfg.clip_ratio_low,
                clip_ratio_high=cfg.clip_ratio_high,
                clip_ratio_c=cfg.clip_ratio_c,
                loss_agg_mode=mode,
                denominator=denom,
                loss_scale_factor=scale,
                is_weights=t.get("is_weights"),  # off-policy correction (asynchronous training), when on
            )
            if entropy is not None:
                ent = agg_loss(entropy, mask, mode, denominator=denom, loss_scale_factor=scale)
                loss = loss - cfg.entropy_coeff * ent
                m[sig.ACTOR_ENTROPY] = float(ent.detach())
            if cfg.use_kl_loss:
                kl, kl_m = kl_loss(
                    log_prob,
                    t["ref_log_prob"],
                    mask,
                    kind=cfg.kl_loss_type,
                    loss_agg_mode=mode,
                    denominator=denom,
                    loss_scale_factor=scale,
                )
                loss = loss + kl_coef * kl
                m.update(kl_m)
            # FSDP averages gradients over ranks; the global denominator already did, so undo the average
            (loss * world_size()).backward()
            parts.append(m)
        grad_norm = fsdp.clip_grad(self.model, cfg.optim.grad_clip)
        self.optim.step()
        # losses are partial sums of the mini-batch loss: scaled so that the mean over ranks is their total
        keys = [k for k in (sig.PG_LOSS, sig.KL_LOSS, sig.ACTOR_ENTROPY) if k in parts[0]]
        summed = {k: sum(p[k] for p in parts) * world_size() for k in keys}
        return {**mean_metrics(parts), **summed, sig.ACTOR_GRAD_NORM: grad_norm}

    # ------------------------------------------------------------------ rollout
    @register(dispatch_mode=ROLLOUT_DISPATCH)  # chunks joined by the driver (join_rows: folded rows differ in width)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        if self.rollout is None:
            raise RuntimeError("generate_sequences: this actor has no rollout engine (trainer.placement=split)")
        return self.rollout.generate(prompts, restore=self._rollout_weights)  # the engine sleeps after the batch

    def _base_state_dict(self, rank0_only: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the base model's names and weights, LoRA merged in, in the compute dtype: what engines and the HF export
        take; the raw gathered state, float32 masters). Collective. `rank0_only`: the other ranks get ({}, {})."""
        state = fsdp.full_state_dict(self.model, rank0_only=rank0_only)
        if not state:  # a rank other than 0 with rank0_only: nothing gathered here
            return state, state
        if not self.use_lora:  # cast in place: the float32 copy is not kept beside the compute-dtype one
            state = fsdp.cast_floating(state, self.dtype)
            return state, state
        return fsdp.cast_floating(lora.merged_state_dict(self.model, state), self.dtype), state

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self, version: int | None = None):
        """Stream the policy into this process's engine as `version`: one gathered parameter at a time, loaded bucket
        by bucket (rollout.update_weights_bucket_mb), so no rank holds a full state dict (LoRA still gathers one to
        merge). Engine weights wake first, its KV cache after (GenerationRunner.load_weights). Collective."""
        if self.rollout is not None:  # every rank has an engine or none: the collectives match
            self.rollout.load_weights(self._rollout_weights(), version)

    def _rollout_weights(self):
        """(name, full tensor) pairs under the base model's names, gathered lazily one parameter at a time as verl's
        FSDP engine does (`get_per_tensor_param`): every rank must consume all of them, in the same order."""
        if self.use_lora:
            return iter(self._base_state_dict()[0].items())

        # references to the local shards: nothing gathered yet. A tied weight is gathered under each of its names:
        # vLLM loads lm_head.weight into a head of its own (measured: without it the head keeps its old weights)
        state = convert_weight_keys(self.model.state_dict(), self.model)
        return ((k, v.full_tensor() if isinstance(v, DTensor) else v) for k, v in state.items())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_state_dict(self, as_ref: bool = False):
        """The policy's weights under the base model's names (LoRA merged): what a rollout engine loads. Collective:
        every rank takes part in the gather, only rank 0 returns them (the others None), so one copy leaves the
        group. `as_ref`: rank 0 puts them in the object store itself and returns a `weights_ref.WeightsRef`, so the
        state dict never travels through the driver (split placement's weight sync)."""
        state = self._base_state_dict(rank0_only=True)[0]
        if self.rank != 0:
            return None
        if not as_ref:
            return state

        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        return WeightsRef(ray.put(state), nbytes=nbytes, n_tensors=len(state))

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, ckpt_dir: str):
        # LoRA: adapters + their optimizer state (the frozen base is rebuilt from model.path)
        sharded_checkpoint.save_checkpoint(ckpt_dir, self.model, self.optim, self.sched)
        merged, raw = self._base_state_dict(rank0_only=True)
        if self.rank == 0:  # a Hugging Face directory any tool (eval, vLLM, transformers) can load
            _export_hf(self.cfg, self.tokenizer, merged, os.path.join(ckpt_dir, "hf"))
            if self.use_lora:  # and the adapter alone, in peft's format
                lora.save_adapter(self.model, raw, os.path.join(ckpt_dir, "adapter"))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, ckpt_dir: str):
        sharded_checkpoint.load_checkpoint(ckpt_dir, self.model, self.optim, self.sched)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_lr_scale(self, scale: float):
        fsdp.set_base_lr(self.optim, self.sched, self.cfg.actor.optim.lr * scale)


def _export_hf(cfg, tokenizer, state: dict[str, torch.Tensor], out_dir: str) -> None:
    """Write `state` as a HF model directory (safetensors + config + tokenizer) in model.dtype."""
    model = load_model(cfg.model, tokenizer, seed=cfg.seed)  # model.dtype: load_state_dict casts into it
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"HF export: state dict mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
