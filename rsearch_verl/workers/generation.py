"""The rollout side of a worker: an inference engine (HF or vLLM) plus the search-aware agent loop.

`GenerationRunner` is plain Python: the colocated actor worker (rsearch_verl/workers/actor.py) owns one next to its
FSDP model, streams the updated weights into it after every update (`load_weights`, bucket by bucket) and lets it
sleep while it trains (`generate(prompts, restore=...)`); in the split placement `GenerationWorker` is a Ray worker of
its own that receives the actor's full state dict from the driver.

`GenerationWorker` is a threaded Ray actor, so weights can arrive while it generates (asynchronous training,
trainer.max_staleness >= 1): with trainer.mid_trajectory_update=continue they go to the engine at once and land
between two decode steps; with `wait` they are parked until the running batch has finished. A batch never starts
before the engine holds at least the policy version the driver asks for (`meta_info["min_version"]`), which is how
the staleness bound holds. `idle_seconds()` reports the time the worker spent not generating.

With trainer.rollout_mode=streaming the driver calls `stream_submit` / `stream_poll` / `stream_metrics` /
`stream_abort` / `stream_reset` on each worker's handle: the worker's trajectory stream (rsearch_verl/rollout/stream.py)
keeps a pool of trajectories generating on the same engine, and validation batches run beside it on the stream's loop.

Every worker's chunk is padded to its own widest row; the driver joins the chunks (`rsearch_verl.batch.join_rows`,
the one owner of row widths: a folded row can be wider than data.max_prompt_length + rollout.max_response_length).

Usage:
    runner = GenerationRunner(cfg, model, tokenizer, device)
    out = runner.generate(prompts)          # DataProto with the rollout keys of rsearch_verl/batch.py
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable

import torch
from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from rsearch_verl.config import RSearchConfig, from_omegaconf
from rsearch_verl.log_setup import quiet_expected_warnings
from rsearch_verl.models import load_model, policy_tokenizer
from rsearch_verl.rollout.agent_loop import generate_batch
from rsearch_verl.rollout.engines import make_engine
from rsearch_verl.rollout.engines.base import Weights
from rsearch_verl.rollout.protocols import protocol_for
from rsearch_verl.rollout.stream import TrajectoryStream
from rsearch_verl.workers.fsdp import local_device
from rsearch_verl.workers.generation_group import ROLLOUT_DISPATCH

logger = logging.getLogger(__name__)


class GenerationRunner:
    """The engine and the agent loop of one process. Colocated, the actor passes `restore` to `generate`: the engine
    wakes for the batch and sleeps after it (level 2: weights and KV cache freed while the actor trains), and the
    sync wakes it in verl's order: weights, load, KV cache. A batch that comes before the next sync (validation, then
    the next step's rollout) gets the weights back from `restore()` first."""

    SLEEP_LEVEL = 2  # verl's level for full-weight sync: the weights are resent anyway (rollout/engines/vllm.py)

    def __init__(self, cfg: RSearchConfig, model: torch.nn.Module, tokenizer, device: torch.device):
        self.cfg, self.tokenizer = cfg, tokenizer
        # one per process (a runner is built once, in the worker's init), handed to every batch's agent loop
        self.protocol = protocol_for(cfg)
        # HF: the engine owns its own copy (the FSDP model's parameters become sharded DTensors); vLLM only reads
        # `model` to start (dummy weights, then these streamed in), so no copy
        engine_model = model if cfg.rollout.engine == "vllm" else copy.deepcopy(model)
        dtype = getattr(torch, cfg.model.dtype)  # the compute dtype, whatever precision the actor's masters keep
        self.engine = make_engine(cfg.rollout, engine_model, tokenizer, device=str(device.type), dtype=dtype)

    def generate(self, prompts: DataProto, restore: Callable[[], Weights] | None = None) -> DataProto:
        """The rollout of `prompts`. `restore` (colocated): returns the policy's weights (may be a collective: every
        rank's engine is in the same state, so all ranks call it together); the engine sleeps after the batch when that
        frees memory (CUDA vLLM): an engine that keeps its weights anyway would only have to reload them."""

        if restore is not None:
            if self.engine.weights_lost:  # slept since the last sync: bring the same version back
                self.load_weights(restore(), self.engine.version)
            self.engine.wake_up()
        out = generate_batch(
            self.engine,
            self.tokenizer,
            prompts,
            self.cfg,
            protocol=self.protocol,
        )
        if restore is not None and self.engine.frees_memory_on_sleep:
            self.engine.sleep(self.SLEEP_LEVEL)  # the actor's turn: log-probs and the update
        return out

    def load_weights(self, weights: Weights, version: int | None = None) -> None:
        """Weights in, verl's order: their memory back, the weights (bucket by bucket), then the KV cache, so the
        sync's temporary buffers never coexist with the KV cache. No-op wakes when the engine is awake."""
        self.engine.wake_up(["weights"])
        self.engine.load_weights(weights, version)
        self.engine.wake_up(["kv_cache"])

    @property
    def version(self) -> int:
        return self.engine.version

    def close(self) -> None:
        self.engine.close()


def build_policy(cfg: RSearchConfig):
    """Tokenizer (with the protocol's special tokens) and the seeded, unsharded policy every process starts from."""

    tokenizer = policy_tokenizer(cfg)
    return tokenizer, load_model(cfg.model, tokenizer, seed=cfg.seed)


class GenerationWorker(Worker):
    """A stand-alone rollout process (trainer.placement=split) on its own GPU: its own engine; the weights arrive as
    the one object-store copy actor rank 0 put (the driver passes the reference, Ray resolves it here)."""

    VERSION_TIMEOUT_S = 600.0  # a batch waiting this long for the weights it needs means the driver is gone

    def __init__(self, cfg_dict: dict):
        quiet_expected_warnings(cpu=cfg_dict["trainer"]["device"] == "cpu")  # before verl looks for a GPU
        super().__init__()
        self.cfg = from_omegaconf(cfg_dict)
        self.runner: GenerationRunner | None = None
        self._generating = threading.Lock()  # one batch at a time; weights may arrive meanwhile
        self._state = threading.Condition()  # guards the fields below; notified when weights land
        self._parked: tuple[dict, int | None] | None = None  # mid_trajectory_update=wait: lands after the batch
        self._busy_s, self._busy_since, self._born = 0.0, None, time.perf_counter()
        self._stream: TrajectoryStream | None = None  # trainer.rollout_mode=streaming

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        torch.manual_seed(self.cfg.seed)
        device = local_device(self.cfg.trainer.device)  # the GPU Ray gave this process (not always cuda:0)
        tokenizer, model = build_policy(self.cfg)
        self.runner = GenerationRunner(self.cfg, model, tokenizer, device)

    @register(dispatch_mode=ROLLOUT_DISPATCH, blocking=False)  # chunks joined by the driver (join_rows)
    def generate_sequences_async(self, prompts: DataProto) -> DataProto:
        """Generate this worker's share of `prompts`; the driver gets futures at once (`PendingGeneration.result()`)."""
        with self._generating:
            self._wait_for_version(int(prompts.meta_info.get("min_version", 0)))
            with self._state:
                self._busy_since = time.perf_counter()
            try:
                if self._stream is not None:  # streaming: validation runs beside the groups in flight
                    return self._stream.run_batch(prompts)
                return self.runner.generate(prompts)
            finally:
                with self._state:
                    self._busy_s += time.perf_counter() - self._busy_since
                    self._busy_since = None
                    parked, self._parked = self._parked, None
                    if parked is not None:  # mid_trajectory_update=wait: it lands now, before a newer update can
                        self.runner.load_weights(*parked)

    def _wait_for_version(self, version: int) -> None:
        with self._state:
            if not self._state.wait_for(lambda: self.runner.version >= version, timeout=self.VERSION_TIMEOUT_S):
                raise TimeoutError(
                    f"rollout worker: waited {self.VERSION_TIMEOUT_S:.0f} s for policy version {version} "
                    f"(the engine holds {self.runner.version}); the driver stopped pushing weights"
                )

    # ---- trainer.rollout_mode=streaming: the driver calls these on each worker's handle (trainer/stream_pipeline.py)
    def stream_submit(self, groups: list[DataProto]) -> None:
        """Queue prompt groups on this worker's trajectory stream (started on first use)."""
        if self._stream is None:
            self._stream = TrajectoryStream(self.runner.engine, self.runner.tokenizer, self.cfg, self.runner.protocol)
        self._stream.submit(groups)

    def stream_poll(self, wait_s: float = 0.0) -> tuple[list[DataProto], dict]:
        """Finished groups since the last poll (waiting up to `wait_s` for one) and the stream's state."""
        if self._stream is None:
            return [], {"in_flight": [], "failed": [], "trajectories_in_flight": 0, "queued_groups": 0, "busy_s": 0.0}
        return self._stream.poll(wait_s)

    def stream_metrics(self) -> dict:
        """The stream's search window since the last call and its counters; hands over no finished group."""
        if self._stream is None:
            return {"metrics": {}, "trajectories_done": 0, "trajectories_in_flight": 0}
        return self._stream.metrics()

    def stream_abort(self, seqs: list[int]) -> int:
        """Cancel these groups; returns the trajectories lost."""
        return self._stream.abort(seqs) if self._stream is not None else 0

    def stream_reset(self) -> int:
        """Cancel everything in flight (rollback, resume); returns the trajectories lost."""
        return self._stream.reset() if self._stream is not None else 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None):
        with self._state:
            if self.cfg.trainer.mid_trajectory_update == "wait":
                if self._busy_since is not None:
                    self._parked = (state_dict, version)  # lands after the batch; a newer update replaces it
                else:  # idle: it lands under the lock, so no batch starts halfway through the copy
                    self.runner.load_weights(state_dict, version)
                    self._state.notify_all()
                return
        self.runner.load_weights(state_dict, version)  # lands between two decode steps of a running batch
        with self._state:
            self._state.notify_all()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def policy_version(self) -> int:
        """The policy version the engine holds (the last weights that landed)."""
        with self._state:
            return self.runner.version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def idle_seconds(self) -> float:
        """Seconds since start-up spent not generating (the driver logs the difference per step)."""
        with self._state:
            busy = self._busy_s + (time.perf_counter() - self._busy_since if self._busy_since is not None else 0.0)
        if self._stream is not None:  # streaming: busy while any trajectory generates (validation runs beside them)
            busy = self._stream.busy_seconds()
        return time.perf_counter() - self._born - busy
