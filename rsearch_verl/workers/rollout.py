"""The rollout side of a worker: an inference engine (HF or vLLM) plus the search-aware agent loop.

`RolloutRunner` is plain Python: the colocated actor worker (rsearch_verl/workers/actor.py) owns one next to its
FSDP model and refreshes it with `load_weights` after every update; in the split placement `RolloutWorker` is a
Ray worker of its own that receives the actor's full state dict from the driver.

Every worker pads its chunk to the same widths (data.max_prompt_length, rollout.max_response_length), so the
chunks concatenate in the driver, which then trims the all-padding columns (`rsearch_verl.batch.trim_padding`).

Usage:
    runner = RolloutRunner(cfg, model, tokenizer, device)
    out = runner.generate(prompts)          # DataProto with the rollout keys of rsearch_verl/batch.py
"""

from __future__ import annotations

import copy
import logging

import torch
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from rsearch_verl.config import RSearchConfig, from_omegaconf

logger = logging.getLogger(__name__)


class RolloutRunner:
    def __init__(self, cfg: RSearchConfig, model: torch.nn.Module, tokenizer, device: torch.device):
        from rsearch_verl.rollout.engines import make_engine
        from rsearch_verl.rollout.protocols import get_protocol

        self.cfg, self.tokenizer = cfg, tokenizer
        self.protocol = get_protocol(cfg.rollout.protocol, **cfg.rollout.protocol_kwargs)
        # the engine owns its own copy: the FSDP model's parameters are sharded DTensors
        self.engine = make_engine(cfg.rollout, copy.deepcopy(model), tokenizer, device=str(device.type))

    def generate(self, prompts: DataProto) -> DataProto:
        from rsearch_verl.rollout.agent_loop import generate_batch

        return generate_batch(
            self.engine,
            self.tokenizer,
            prompts,
            self.cfg,
            protocol=self.protocol,
            pad_prompt_to=self.cfg.data.max_prompt_length,
            pad_response_to=self.cfg.rollout.max_response_length,
        )

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.engine.load_weights(state_dict)

    def close(self) -> None:
        self.engine.close()


def build_policy(cfg: RSearchConfig):
    """Tokenizer (with the protocol's special tokens) and the seeded, unsharded policy every process starts from."""
    from rsearch_verl.models import load_model, policy_tokenizer

    tokenizer = policy_tokenizer(cfg)
    return tokenizer, load_model(cfg.model, tokenizer, seed=cfg.seed)


class RolloutWorker(Worker):
    """A stand-alone rollout process (trainer.placement=split): its own engine, weights pushed by the driver."""

    def __init__(self, cfg_dict: dict):
        super().__init__()
        self.cfg = from_omegaconf(cfg_dict)
        self.runner: RolloutRunner | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        torch.manual_seed(self.cfg.seed)
        device = torch.device("cuda", 0) if self.cfg.trainer.device == "cuda" else torch.device("cpu")
        tokenizer, model = build_policy(self.cfg)
        self.runner = RolloutRunner(self.cfg, model, tokenizer, device)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        return self.runner.generate(prompts)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_weights(self, state_dict: dict[str, torch.Tensor]):
        self.runner.load_weights(state_dict)
