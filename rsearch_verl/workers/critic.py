"""The critic worker (PPO / GAE): a value model — the policy's transformer backbone plus a scalar head —
sharded with FSDP2, on `verl.single_controller` like the actor.

Methods (DP_COMPUTE_PROTO splits the batch over ranks):
    init_model()                 backbone from the same weights as the policy (as in Search-R1), head zero-init;
                                 with LoRA (model.lora_rank > 0) the backbone is frozen and carries its own adapters;
                                 float32 masters (value head included), forward / backward in model.dtype
    compute_values(batch)        -> values [B, R]: V(state before each response token)
    update_critic(batch)         clipped value loss on the batch's loss_mask; meta_info["metrics"] (critic/*)
    save_checkpoint(dir) / load_checkpoint(dir)
    set_lr_scale(scale)          lr = critic.optim.lr x scale from now on (the health watchdog's rollback)
"""

from __future__ import annotations

import logging

import torch
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from rsearch_verl import signals as sig
from rsearch_verl.algos.losses import value_loss
from rsearch_verl.config import from_omegaconf
from rsearch_verl.log_setup import quiet_expected_warnings
from rsearch_verl.models import load_model, policy_tokenizer
from rsearch_verl.workers import fsdp, lora, sharded_checkpoint
from rsearch_verl.workers.forward import (
    check_remove_padding,
    global_denominator,
    mean_metrics,
    response_values,
    world_size,
)
from rsearch_verl.workers.packing import micro_batches, restore_order
from rsearch_verl.workers.varlen_attention import configure_attention

logger = logging.getLogger(__name__)


class ValueModel(torch.nn.Module):
    """`model` is the causal LM's decoder (attribute name kept so FSDP wraps its layers); `value_head` maps the
    last hidden state to a scalar per position."""

    def __init__(self, causal_lm: torch.nn.Module):
        super().__init__()
        self.model = causal_lm.model
        self.value_head = torch.nn.Linear(causal_lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """[b, S] values; `attention_mask=None` with packed position ids: one packed row (workers/packing.py)."""
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1).clone()  # FSDP2 warns on returning a view


class CriticWorker(Worker):
    def __init__(self, cfg_dict: dict):
        quiet_expected_warnings(cpu=cfg_dict["trainer"]["device"] == "cpu")  # before verl looks for a GPU
        super().__init__()
        self.cfg = from_omegaconf(cfg_dict)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        cfg = self.cfg
        self.device = fsdp.init_distributed(cfg.trainer.device, cfg.trainer.nccl_timeout_s)
        dtype = fsdp.compute_dtype(cfg.model)
        torch.manual_seed(cfg.seed)
        tokenizer = policy_tokenizer(cfg)
        lm = load_model(cfg.model, tokenizer, seed=cfg.seed, dtype=fsdp.MASTER_DTYPE)
        configure_attention(lm, cfg.model, cfg.critic.use_remove_padding)
        if lora.lora_enabled(cfg.model):  # the critic's own adapters on a frozen backbone; the value head trains fully
            lm = lora.add_lora(lm, cfg.model).get_base_model()
        # the value head joins the backbone's float32 master tree; FSDP runs both in `dtype` (values come back
        # float32 from forward.response_values, for the loss)
        self.model = fsdp.shard_model(ValueModel(lm), self.device, dtype)
        self.optim, self.sched = fsdp.build_optimizer(self.model, cfg.critic.optim, total_steps=cfg.trainer.total_steps)
        if cfg.critic.use_remove_padding:
            check_remove_padding(self.model, self.device, len(tokenizer), values=True, dtype=dtype)

    def _micro_batches(self, data: DataProto) -> tuple[list[DataProto], list[int] | None]:
        cfg = self.cfg.critic
        budget = cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
        return micro_batches(data, cfg.micro_batch_size, budget, self.device)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @torch.no_grad()
    def compute_values(self, data: DataProto) -> DataProto:
        self.model.eval()
        micros, order = self._micro_batches(data)
        rmpad = self.cfg.critic.use_remove_padding
        values = restore_order(
            torch.cat([response_values(self.model, m, self.device, remove_padding=rmpad).cpu() for m in micros]), order
        )
        # 0 outside the loss mask: with masking on, observation positions are no state of the value chain
        return DataProto.from_dict(tensors={"values": values * data.batch["loss_mask"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        cfg = self.cfg.critic
        # folded trajectories (more rows than trajectories): the driver says how many optimizer steps an epoch makes
        steps = data.meta_info.get("mini_batches", {}).get("critic")
        mini = cfg.ppo_mini_batch_size // world_size() if steps is None else -(-len(data) // steps)
        self.model.train()
        rows = []
        for _ in range(cfg.ppo_epochs):
            for start in range(0, len(data), mini):
                rows.append(self._optimizer_step(data[start : start + mini]))
        self.sched.step()
        metrics = fsdp.all_reduce_mean(mean_metrics(rows), self.device)
        metrics["critic/lr"] = self.sched.get_last_lr()[0]
        metrics.update(fsdp.param_metrics(self.model, self.optim, self.device, "critic"))
        return DataProto(meta_info={"metrics": metrics})

    def _optimizer_step(self, minibatch: DataProto) -> dict[str, float]:
        cfg = self.cfg.critic
        denom = global_denominator(minibatch.batch["loss_mask"], cfg.loss_agg_mode, self.device)
        self.optim.zero_grad(set_to_none=True)
        parts = []
        for micro in self._micro_batches(minibatch)[0]:
            t = {k: v.to(self.device) for k, v in micro.batch.items()}
            values = response_values(self.model, micro, self.device, remove_padding=cfg.use_remove_padding)
            loss, m = value_loss(
                values=values,
                old_values=t["values"],
                returns=t["returns"],
                response_mask=t["loss_mask"],
                cliprange_value=cfg.cliprange_value,
                loss_agg_mode=cfg.loss_agg_mode,
                denominator=denom,
                loss_scale_factor=self.cfg.loss_scale_factor,
            )
            (loss * world_size()).backward()  # undo FSDP's gradient average: the denominator is already global
            parts.append(m)
        grad_norm = fsdp.clip_grad(self.model, cfg.optim.grad_clip)
        self.optim.step()
        vf_loss = sum(p[sig.VF_LOSS] for p in parts) * world_size()  # the mean over ranks is the total
        return {**mean_metrics(parts), sig.VF_LOSS: vf_loss, sig.CRITIC_GRAD_NORM: grad_norm}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, ckpt_dir: str):
        sharded_checkpoint.save_checkpoint(ckpt_dir, self.model, self.optim, self.sched)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, ckpt_dir: str):
        sharded_checkpoint.load_checkpoint(ckpt_dir, self.model, self.optim, self.sched)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_lr_scale(self, scale: float):
        fsdp.set_base_lr(self.optim, self.sched, self.cfg.critic.optim.lr * scale)
