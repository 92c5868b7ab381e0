"""The training loop: the single controller that drives the worker groups one step at a time.

`Trainer.train_step` is the step of docs/architecture.md, one commented call per phase:
generate (search-aware rollout) → loss mask → reward → old log-probs → reference log-probs → values → advantages →
critic update → actor update → weight sync → rollout dump. Every phase is `phase(batch, ...) -> (batch, metrics)`
(trainer/phases.py; the worker calls are methods here) and `StepMetrics.phase` is the one place their metrics merge.
`fit` adds validation (before the first update, every `trainer.test_freq` steps and at the end), metrics, atomic
checkpoints every `trainer.save_freq` steps and at the end, and `trainer.resume=auto` (continue from the newest
complete checkpoint).

Run health (rsearch_verl/trainer/health, docs/health.md): trajectories whose searches failed because the retriever
was down get no loss. Between steps the run control (rsearch_verl/trainer/run_control.py) checks the retriever before
every step and watches it during, and decides: a rollback to the last complete checkpoint at a lower lr when the
watchdog trips, a stop when the run cannot go on safely (retriever gone past its deadline, a dead Ray worker, rollbacks
used up). This loop carries the decisions out: it restores, saves what can be saved and raises `RunStopped`.

Run it through the Hydra entry point: `python -m rsearch_verl.main +recipe=search_r1_ppo`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping

from verl import DataProto

from rsearch_verl import signals as sig
from rsearch_verl.config import RSearchConfig, public_dict
from rsearch_verl.data.dataset import PromptDataset, PromptLoader
from rsearch_verl.rollout.dump import write_rollout_dump
from rsearch_verl.rollout.protocols import SearchProtocol
from rsearch_verl.search.supervisor import RetrieverSupervisor
from rsearch_verl.trainer import phases
from rsearch_verl.trainer.batch_pipeline import BatchPipeline
from rsearch_verl.trainer.checkpoint import CheckpointManager
from rsearch_verl.trainer.health import RunStopped
from rsearch_verl.trainer.health.report import RunHealth
from rsearch_verl.trainer.metrics_log import MetricsLogger
from rsearch_verl.trainer.prefetch import PREFETCHED_OLD, PREFETCHED_REF, LogProbPrefetch, fill_log_probs
from rsearch_verl.trainer.run_control import Continue, RollbackTo, RunControl, Stop
from rsearch_verl.trainer.stream_pipeline import StreamingPipeline
from rsearch_verl.workers.metrics import reduce_metrics
from rsearch_verl.workers.placement import WorkerGroups

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def timed(timing: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timing[f"timing/{name}_s"] = time.perf_counter() - start


Phase = Callable[..., tuple[DataProto, Mapping[str, float]]]


class StepMetrics:
    """One step's metrics, merged one way: `add`, in phase order (no two phases write the same key)."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    def add(self, metrics: Mapping[str, float]) -> None:
        self.metrics.update(metrics)

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.add({f"timing/{name}_s": time.perf_counter() - start})

    def phase(self, name: str | None, fn: Phase, *inputs) -> DataProto:
        """Run one phase, `fn(*inputs) -> (batch, metrics)`; add its metrics (and `timing/<name>_s` when named) and
        return its batch."""
        with self.timed(name) if name else contextlib.nullcontext():
            batch, metrics = fn(*inputs)
        self.add(metrics)
        return batch


class Trainer:
    def __init__(
        self,
        cfg: RSearchConfig,
        run_dir: str,
        workers: WorkerGroups,
        train_data: PromptDataset,
        val_data: PromptDataset | None,
        tokenizer,
        protocol: SearchProtocol,
        supervisor: RetrieverSupervisor | None = None,
    ):
        self.cfg, self.run_dir, self.wg, self.tokenizer = cfg, run_dir, workers, tokenizer
        self.protocol = protocol  # the run's: rewards read answers with the protocol the rollout used
        self.loader = PromptLoader(train_data, cfg.data.train_batch_size, seed=cfg.seed, shuffle=cfg.data.shuffle)
        # each step's batch: generated at the step's start, ahead while the actor trains (trainer.max_staleness), or
        # admitted from the rollout workers' streams of trajectories (trainer.rollout_mode=streaming)
        if cfg.trainer.rollout_mode == "streaming":
            prefetch = None  # the actor's log-probs of finished groups while a step waits (trainer/prefetch.py)
            if cfg.trainer.prefetch_log_probs != "off":
                prefetch = LogProbPrefetch(self._prefetch_compute, with_ref=cfg.use_ref, world_size=cfg.world_size)
            self.rollouts = StreamingPipeline(workers.rollout, self.loader, cfg, self._sampling_seed, prefetch)
        else:
            self.rollouts = BatchPipeline(workers.rollout, self.loader, cfg, self._sampling_seed)
        self.val_data = val_data
        self.ckpts = CheckpointManager(run_dir, max_to_keep=cfg.trainer.max_ckpt_to_keep)
        self.metrics = MetricsLogger(
            run_dir,
            cfg.trainer.loggers,
            project=cfg.trainer.project_name,
            name=cfg.trainer.experiment_name or os.path.basename(run_dir),
            config=public_dict(cfg),  # retriever.token redacted
        )
        self.history: list[dict] = []
        self.health = RunHealth()
        # between steps: decides the watchdog's rollbacks, stops and what they save; this loop carries them out
        self.control = RunControl(self.ckpts, self.health, cfg.trainer.watchdog, supervisor)
        self._rollout_idle = workers.rollout_idle_seconds()  # the split rollout workers' idle clock at the last step

    # ---------------------------------------------------------------- one step
    def train_step(self, step: int) -> dict[str, float]:
        """One step: each line one phase, `batch -> (batch, metrics)`; `rec.phase` runs it and merges its metrics."""
        cfg, rec = self.cfg, StepMetrics()
        with rec.timed("step"):
            # 1. rollout: multi-turn generation with search; response_mask is 0 on inserted observations. With
            #    trainer.max_staleness >= 1 the batch was generated while earlier steps trained: this only waits
            batch = rec.phase("gen", self._generate, step)
            batch = rec.phase(None, phases.rollout_phase, batch)  # the workers' search counters; rollout/* stats
            # 2. loss_mask, the one place that decides which tokens any loss sees (rows met by an outage: none)
            batch = rec.phase(None, phases.loss_mask_phase, batch, cfg, step)
            batch = rec.phase(None, phases.fit_rows, batch, cfg)  # folded trajectories: rows padded for the updates
            batch = rec.phase(None, phases.worker_args_phase, batch, cfg, step)  # temperature, kl_coef, step
            # 3. rewards from the recipe's reward function (rule-based or judged)
            batch = rec.phase("reward", phases.reward_phase, batch, cfg, self.protocol)
            # 4. log-probs of the sampled tokens under the current policy (= the one that generated them, when
            #    synchronous; the proximal policy of the off-policy correction otherwise)
            batch = rec.phase("old_log_prob", self._old_log_prob, batch)
            batch = rec.phase(None, phases.logprob_check_phase, batch, step)  # weight-sync gap, sampled entropy
            batch = rec.phase(None, phases.off_policy_phase, batch, cfg)  # importance weights for stale samples
            # 5. reference log-probs for the KL term
            if cfg.use_ref:
                batch = rec.phase("ref", self._ref_log_prob, batch)
            # 6. values from the critic (PPO / GAE only)
            if cfg.use_critic:
                batch = rec.phase("values", self._values, batch)
            # 7. KL-in-reward and advantages (driver, pure tensor functions, mask-aware)
            batch = rec.phase("adv", phases.advantage_phase, batch, cfg, step)
            # 8. critic and actor updates, on ids checked once more against the engine's record (rollout/round_trip.py)
            batch = rec.phase(None, phases.round_trip_phase, batch)
            batch = rec.phase(None, self._update, batch)
            # 9. push the new weights into the rollout engines (split: between two decode steps of the next batch)
            batch = rec.phase("sync", self._sync, batch, step)
        # 10. rollout dump for inspection (viewer, debugging)
        if cfg.trainer.dump_rollouts:
            write_rollout_dump(os.path.join(self.run_dir, "rollouts", f"step_{step}.jsonl"), batch, self.tokenizer)
        rec.add(self._idle_times(rec.metrics))
        return rec.metrics

    # the worker phases: (batch, ...) -> (batch, metrics), as trainer/phases.py's
    def _generate(self, step: int) -> tuple[DataProto, dict[str, float]]:
        return self.rollouts.take(step), {}

    def _old_log_prob(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        return self._fill(batch, "old_log_probs", PREFETCHED_OLD, self.wg.actor.compute_log_prob), {}

    def _ref_log_prob(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        return self._fill(batch, "ref_log_prob", PREFETCHED_REF, self.wg.actor.compute_ref_log_prob), {}

    def _fill(self, batch: DataProto, key: str, flag: str, compute) -> DataProto:
        """`key` for every row; a streamed batch's prefetched rows have it already (trainer/prefetch.py)."""
        check = self.cfg.trainer.prefetch_log_probs == "check"
        return fill_log_probs(batch, key, flag, compute, self.cfg.world_size, check)[0]

    def _prefetch_compute(self, batch: DataProto, old: bool, ref: bool) -> DataProto:
        """Finished groups' proximal and / or reference log-probs, at the rollout temperature (trainer/prefetch.py)."""
        batch.meta_info.update(temperature=self.cfg.rollout.temperature)
        if not ref:
            return self.wg.actor.compute_log_prob(batch)
        out = self.wg.actor.compute_ref_log_prob(batch)
        return out.union(self.wg.actor.compute_log_prob(batch)) if old else out

    def _values(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        return batch.union(self.wg.critic.compute_values(batch)), {}

    def _update(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        """The critic's and the actor's updates, unless every trajectory was dropped (the update is skipped)."""
        metrics = {sig.UPDATE_SKIPPED: float(not batch.batch["loss_mask"].any())}
        if metrics[sig.UPDATE_SKIPPED]:
            return batch, metrics
        if self.cfg.use_critic:
            with timed(metrics, "update_critic"):
                metrics.update(_worker_metrics(self.wg.critic.update_critic(batch)))
        with timed(metrics, "update_actor"):
            metrics.update(_worker_metrics(self.wg.actor.update_actor(batch)))
        return batch, metrics

    def _sync(self, batch: DataProto, step: int) -> tuple[DataProto, dict[str, float]]:
        return batch, self.wg.sync_rollout_weights(version=step)  # sync/bytes: what left the actor processes

    def _idle_times(self, timing: dict[str, float]) -> dict[str, float]:
        """Split placement: seconds of this step each role sat idle (the actor: everything but its own calls)."""
        idle = self.wg.rollout_idle_seconds()
        if idle is None:
            return {}
        busy = sum(v for k, v in timing.items() if k in _ACTOR_PHASES)
        rollout_idle, self._rollout_idle = idle - self._rollout_idle, idle
        return {"timing/rollout_idle_s": rollout_idle, "timing/actor_idle_s": timing["timing/step_s"] - busy}

    # ---------------------------------------------------------------- validation
    def validate(self) -> dict[str, float]:
        if self.val_data is None:
            return {}
        n = len(self.val_data)
        limit = n if self.cfg.data.val_max_samples < 0 else min(n, self.cfg.data.val_max_samples)
        results = []
        for start in range(0, limit, self.cfg.data.val_batch_size):
            idx = list(range(start, min(limit, start + self.cfg.data.val_batch_size)))
            batch = self.val_data.to_batch(idx, uids=[f"val-{i}" for i in idx])
            batch.meta_info.update(validate=True, seed=self.cfg.seed, min_version=self.control.done_step)
            batch = self.wg.rollout.generate_sequences(batch)
            self.health.add_step(batch.meta_info.pop("metrics", {}))  # searches failed or paused in validation too
            batch, _ = phases.reward_phase(batch, self.cfg, self.protocol)
            results.append(DataProto(non_tensor_batch=batch.non_tensor_batch))  # widths differ between batches
        return phases.validation_metrics(DataProto.concat(results))

    # ---------------------------------------------------------------- checkpoints
    def save(self, step: int) -> None:
        parts = ("actor",) if self.wg.critic is None else ("actor", "critic")
        with self.ckpts.writing(step, parts=parts) as tmp:  # complete only with every rank's shards of each part
            self.wg.actor.save_checkpoint(os.path.join(tmp, "actor"))
            if self.wg.critic is not None:
                self.wg.critic.save_checkpoint(os.path.join(tmp, "critic"))
            # the loader before the oldest batch not trained: batches generated ahead are generated again on resume
            state = {"step": step, "loader": self.rollouts.resume_state(), "health": self.health.state_dict()}
            self.ckpts.write_trainer_state(tmp, state)

    def maybe_resume(self) -> int:
        """Load the checkpoint `trainer.resume` points at; return the step it finished (0 for a fresh run)."""
        self.ckpts.sweep_incomplete()
        path = self.ckpts.resolve(self.cfg.trainer.resume)
        if path is None:  # a fresh run: rows an earlier run left in this run directory are not its rows
            self.metrics.truncate(after_step=-1)
            return 0
        logger.info("resuming from %s", path)
        step, state = self.restore(path)
        self.health.load_state_dict(state.get("health"))
        if self.health.lr_scale != 1.0:  # the optimizer state has it already; this keeps the two in step
            self.set_lr_scale(self.health.lr_scale)
        return step

    def restore(self, path: str) -> tuple[int, dict]:
        """Restore workers, data order and driver RNG from a complete checkpoint; drop the metrics logged after it."""
        self.rollouts.discard()  # batches generated ahead from the weights being replaced
        self.wg.actor.load_checkpoint(os.path.join(path, "actor"))
        if self.wg.critic is not None:
            self.wg.critic.load_checkpoint(os.path.join(path, "critic"))
        state = self.ckpts.read_trainer_state(path)
        self.rollouts.load_state(state["loader"])
        self.wg.sync_rollout_weights(version=int(state["step"]))
        self.metrics.truncate(after_step=state["step"])
        self.history = [row for row in self.history if row["step"] <= state["step"]]
        return int(state["step"]), state

    def set_lr_scale(self, scale: float) -> None:
        self.wg.actor.set_lr_scale(scale)
        if self.wg.critic is not None:
            self.wg.critic.set_lr_scale(scale)

    # ---------------------------------------------------------------- the run
    def fit(self, progress=None) -> list[dict]:
        start = self.maybe_resume()
        self.control.done_step = start
        with contextlib.closing(self.metrics):
            try:
                stop, cause = self._run(start, progress), None  # a Stop here: the watchdog cannot roll back
            except Exception as exc:
                stop, cause = self.control.stopped(exc), exc  # the Stop an error amounts to
                if stop is None:  # a crash: raised as it is
                    raise
            if stop is not None:
                self._halt(stop, cause)
        return self.history

    def _run(self, start: int, progress) -> Stop | None:
        cfg, control = self.cfg.trainer, self.control
        if start == 0 and cfg.val_before_train:
            with control.supervised(0):
                self.log(self.validate(), step=0)
        step = start
        while step < cfg.total_steps:
            step += 1
            with control.supervised(step):
                metrics = self.train_step(step)
            decision = control.judge(step, metrics)
            if isinstance(decision, Stop):
                return decision
            if isinstance(decision, RollbackTo):  # the step's row is never logged; the steps after it are redone
                step = self._roll_back(decision)
                continue
            self._commit(step, decision, progress)
        return None

    def _commit(self, step: int, decision: Continue, progress) -> None:
        """The update of `step` counts. In this order: the pipeline lets go of the step's batch (a checkpoint stores
        the loader after it), validation when due, the row (written also when validation is cut short: a stop then
        saves this update, and its row must be in metrics.jsonl), the checkpoint when due."""
        cfg, row = self.cfg.trainer, dict(decision.row)
        self.rollouts.applied()
        last = step == cfg.total_steps
        try:
            if last or (cfg.test_freq > 0 and step % cfg.test_freq == 0):
                with self.control.supervised(step):
                    row.update(self.validate())
        finally:
            self.log(row, step)
        if last or (cfg.save_freq > 0 and step % cfg.save_freq == 0):
            self.save(step)
        if progress is not None:
            progress(step, row)

    def _roll_back(self, to: RollbackTo) -> int:
        """Restore the checkpoint, then lower the lr (the restore loads the optimizer's lr); the restored step."""
        step, _ = self.restore(to.path)
        self.set_lr_scale(to.lr_scale)
        return step

    def _halt(self, stop: Stop, cause: BaseException | None) -> None:
        """Save what the stop saves, then raise it (python -m rsearch_verl.main exits 3)."""
        if stop.save_step is not None:
            self.save(stop.save_step)
        logger.error("%s", stop.message)
        raise RunStopped(stop.message) from cause

    def log(self, metrics: dict, step: int) -> None:
        if metrics:
            self.metrics.log(metrics, step)
            self.history.append({"step": step, **metrics})

    def _sampling_seed(self, step: int) -> int:
        # rollout sampling is seeded per step, so a resumed run samples what an uninterrupted one would
        return self.cfg.seed * 1_000_003 + step


_ACTOR_PHASES = {
    f"timing/{k}_s" for k in ("prefetch", "old_log_prob", "ref", "values", "update_critic", "update_actor", "sync")
}


def _worker_metrics(out: DataProto) -> dict[str, float]:
    return reduce_metrics(out.meta_info)
