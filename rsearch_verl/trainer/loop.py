"""The training loop: the single controller that drives the worker groups one step at a time.

`Trainer.train_step` is the step of docs/architecture.md, one commented call per phase:
generate (search-aware rollout) → reward → old log-probs → reference log-probs → values → advantages →
critic update → actor update → weight sync → rollout dump. `fit` adds validation (before the first update, every
`trainer.test_freq` steps and at the end), metrics, atomic checkpoints every `trainer.save_freq` steps and at the
end, and `trainer.resume=auto` (continue from the newest complete checkpoint).

Run health (rsearch_verl/trainer/health, docs/health.md): the retriever is checked before every step and watched
during it; trajectories whose searches failed because the retriever was down get no loss; after every step the
watchdog may roll back to the last complete checkpoint at a lower lr. A run that cannot go on safely (retriever gone
past its deadline, a dead Ray worker, rollbacks used up) raises `RunStopped` after saving what can be saved.

Run it through the Hydra entry point: `python -m rsearch_verl.main +recipe=search_r1_ppo`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

from verl import DataProto

from rsearch_verl import batch as batch_keys
from rsearch_verl.config import RSearchConfig, public_dict
from rsearch_verl.data.dataset import PromptDataset, PromptLoader
from rsearch_verl.rollout.dump import write_rollout_dump
from rsearch_verl.search.breaker import RetrieverDownError
from rsearch_verl.search.client import SearchAuthError
from rsearch_verl.search.supervisor import RetrieverSupervisor
from rsearch_verl.trainer import phases
from rsearch_verl.trainer.checkpoint import CheckpointManager
from rsearch_verl.trainer.health import RunStopped, fault_nan_step
from rsearch_verl.trainer.health.report import RunHealth
from rsearch_verl.trainer.health.watchdog import Watchdog
from rsearch_verl.trainer.logging import MetricsLogger
from rsearch_verl.trainer.rollout_pipeline import RolloutPipeline
from rsearch_verl.workers.placement import WorkerGroups, reduce_metrics

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def timed(timing: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timing[f"timing/{name}_s"] = time.perf_counter() - start


class Trainer:
    def __init__(
        self,
        cfg: RSearchConfig,
        run_dir: str,
        workers: WorkerGroups,
        train_data: PromptDataset,
        val_data: PromptDataset | None,
        tokenizer,
        supervisor: RetrieverSupervisor | None = None,
    ):
        self.cfg, self.run_dir, self.wg, self.tokenizer = cfg, run_dir, workers, tokenizer
        self.loader = PromptLoader(train_data, cfg.data.train_batch_size, seed=cfg.seed, shuffle=cfg.data.shuffle)
        # each step's batch: generated at the step's start, or ahead while the actor trains (trainer.max_staleness)
        self.rollouts = RolloutPipeline(workers.rollout, self.loader, cfg, self._sampling_seed)
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
        self.supervisor, self.watchdog, self.health = supervisor, Watchdog(cfg.trainer.watchdog), RunHealth()
        self.done_step = 0  # the last step whose update is applied
        self._pending: dict | None = None  # {"metrics"} of a step whose update is applied, until they are logged
        self._marks: dict[str, float] = {}  # the last rollback's trip metrics, logged with the next row
        self._nan_step = fault_nan_step()  # test-only fault injection (unset in real runs)
        self._rollout_idle = workers.rollout_idle_seconds()  # the split rollout workers' idle clock at the last step

    # ---------------------------------------------------------------- one step
    def train_step(self, step: int) -> dict[str, float]:
        cfg, wg, timing = self.cfg, self.wg, {}
        with timed(timing, "step"):
            # 1. rollout: multi-turn generation with search; response_mask is 0 on inserted observations. With
            #    trainer.max_staleness >= 1 the batch was generated while earlier steps trained: this only waits
            with timed(timing, "gen"):
                batch = self.rollouts.take(step)
            metrics = {**batch.meta_info.pop("metrics", {}), **phases.rollout_metrics(batch)}
            # trajectories whose search failed because the retriever was down, or (never, by construction) that are
            # older than the staleness bound, are dropped from the update
            dropped = phases.drop_rows(
                batch,
                phases.failed_search_rows(batch, cfg, metrics),
                phases.stale_rows(batch, step, cfg.trainer.max_staleness, metrics),
            )
            # the one place that decides which response tokens any loss sees (observations masked or not)
            batch.batch["loss_mask"] = batch_keys.loss_mask(batch.batch, cfg.algorithm.mask_observations, dropped)
            batch.meta_info["temperature"] = cfg.rollout.temperature  # every log-prob below uses logits / T
            # 2. rewards from the recipe's reward function (rule-based or judged)
            with timed(timing, "reward"):
                batch, reward_metrics = phases.reward_phase(batch, cfg)
            # 3. log-probs of the sampled tokens under the current policy (= the one that generated them, when
            #    synchronous; the proximal policy of the off-policy correction otherwise)
            with timed(timing, "old_log_prob"):
                batch = batch.union(wg.actor.compute_log_prob(batch))
            metrics.update(**phases.rollout_logprob_gap(batch, step - 1), **phases.sampled_entropy(batch, step - 1))
            metrics.update(phases.off_policy_phase(batch, cfg))  # importance weights for stale samples
            # 4. reference log-probs for the KL term
            if cfg.use_ref:
                with timed(timing, "ref"):
                    batch = batch.union((wg.ref or wg.actor).compute_ref_log_prob(batch))
            # 5. values from the critic (PPO / GAE only)
            if cfg.use_critic:
                with timed(timing, "values"):
                    batch = batch.union(wg.critic.compute_values(batch))
            # 6. KL-in-reward and advantages (driver, pure tensor functions, mask-aware)
            with timed(timing, "adv"):
                batch, adv_metrics = phases.advantage_phase(batch, cfg, step)
            batch.meta_info["kl_coef"] = phases.current_kl_coef(cfg, step)
            if step == self._nan_step:  # test-only: a NaN loss in the first attempt at this step
                batch.meta_info["fault_nan_loss"], self._nan_step = True, None
            metrics["health/update_skipped"] = float(not batch.batch["loss_mask"].any())  # every trajectory dropped
            if not metrics["health/update_skipped"]:
                # 7. critic update
                if cfg.use_critic:
                    with timed(timing, "update_critic"):
                        metrics.update(_worker_metrics(wg.critic.update_critic(batch)))
                # 8. actor update
                with timed(timing, "update_actor"):
                    metrics.update(_worker_metrics(wg.actor.update_actor(batch)))
            # 9. push the new weights into the rollout engines (split: between two decode steps of the next batch)
            with timed(timing, "sync"):
                metrics.update(wg.sync_rollout_weights(version=step))  # sync/bytes: what left the actor processes
        # 10. rollout dump for inspection (viewer, debugging)
        if cfg.trainer.dump_rollouts:
            path = os.path.join(self.run_dir, "rollouts", f"step_{step}.jsonl")
            write_rollout_dump(path, batch, self.tokenizer)
        timing.update(self._idle_times(timing))
        return {**metrics, **reward_metrics, **adv_metrics, **timing}

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
            batch.meta_info.update(validate=True, seed=self.cfg.seed, min_version=self.done_step)
            batch = self.wg.rollout.generate_sequences(batch)
            self.health.add_step(batch.meta_info.pop("metrics", {}))  # searches failed or paused in validation too
            batch, _ = phases.reward_phase(batch, self.cfg)
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
        step, state = self._load(path)
        self.health.load_state_dict(state.get("health"))
        if self.health.lr_scale != 1.0:  # the optimizer state has it already; this keeps the two in step
            self._set_lr_scale(self.health.lr_scale)
        return step

    def _load(self, path: str) -> tuple[int, dict]:
        """Restore workers, data order and driver RNG from a complete checkpoint; drop the metrics logged after it."""
        self.rollouts.discard()  # batches generated ahead from the weights being replaced
        self.wg.actor.load_checkpoint(os.path.join(path, "actor"))
        if self.wg.critic is not None:
            self.wg.critic.load_checkpoint(os.path.join(path, "critic"))
        state = self.ckpts.read_trainer_state(path)
        self.loader.load_state_dict(state["loader"])
        self.wg.sync_rollout_weights(version=int(state["step"]))
        self.metrics.truncate(after_step=state["step"])
        self.history = [row for row in self.history if row["step"] <= state["step"]]
        return int(state["step"]), state

    def _set_lr_scale(self, scale: float) -> None:
        self.wg.actor.set_lr_scale(scale)
        if self.wg.critic is not None:
            self.wg.critic.set_lr_scale(scale)

    # ---------------------------------------------------------------- health
    def rollback(self, step: int, trips: dict[str, float], metrics: dict[str, float]) -> int:
        """The watchdog tripped at `step`: restore the last complete checkpoint, lower the lr, return its step. The
        step's row is never logged; its trips and retriever outage counts go to the next row."""
        wd = self.cfg.trainer.watchdog
        what = ", ".join(f"{k}={v:.4g}" for k, v in trips.items())
        path = self.ckpts.latest()
        if path is None or len(self.health.rollbacks) >= wd.max_rollbacks:
            why = (
                "there is no complete checkpoint to roll back to (lower trainer.save_freq)"
                if path is None
                else f"all {wd.max_rollbacks} rollbacks are used (trainer.watchdog.max_rollbacks)"
            )
            raise RunStopped(f"health watchdog tripped at step {step} ({what}) and {why}")
        restored, _ = self._load(path)
        self.done_step, self._pending = restored, None
        scale = self.health.lr_scale * wd.lr_factor
        self._set_lr_scale(scale)
        self.health.record_rollback(step, restored, trips, scale)
        self.watchdog.forget_after(restored)
        self._marks = {**{f"health/trip_{k}": 1.0 for k in trips}, "health/rolled_back_from": float(step)}
        self._marks.update({k: metrics[k] for k in ("retriever/restarts", "retriever/down_s") if k in metrics})
        logger.warning("health watchdog tripped at step %d (%s): rolled back to step %d, lr x%g", step, what,
                       restored, scale)  # fmt: skip
        return restored

    @contextlib.contextmanager
    def _supervised(self, step: int) -> Iterator[None]:
        """Check the retriever before the body and watch it during; its outage metrics go to the step's row."""
        if self.supervisor is None:
            yield
            return
        try:
            self.supervisor.check()
            with self.supervisor.watching():
                yield
        finally:
            self.health.add_outages(self.supervisor.take_outages(), step)

    def _stopped(self, exc: BaseException) -> RunStopped | None:
        """The RunStopped that `exc` amounts to (checkpointing first where that is safe), or None for other errors."""
        import ray

        step = self.done_step + 1
        cause = getattr(exc, "cause", None) or exc  # a RayTaskError carries the worker's exception as its cause
        if isinstance(exc, RunStopped):
            reason, advice = str(exc), "Fix the cause, then rerun with the same trainer.run_dir (trainer.resume=auto)."
        elif isinstance(cause, RetrieverDownError):
            reason = str(cause).splitlines()[0]
            if self.supervisor is not None and (outage := self.supervisor.open_outage()) is not None:
                self.health.add_outages([outage], step)
            saved = self._save_on_stop(step, reason)
            advice = f"{saved} {self._retriever_advice()}, then rerun with the same trainer.run_dir "
            advice += "(trainer.resume=auto) to continue."
        elif isinstance(cause, SearchAuthError):  # a rejected credential: every search would fail the same way
            reason, advice = str(cause).splitlines()[0], "Fix the credential, then rerun with the same trainer.run_dir."
        elif isinstance(exc, ray.exceptions.RayActorError | ray.exceptions.WorkerCrashedError):
            reason = f"a Ray worker died ({type(exc).__name__}: {str(exc).splitlines()[0][:300]})"
            latest = self.ckpts.latest()
            advice = (
                f"The last complete checkpoint is {latest}; rerun with the same trainer.run_dir "
                "(trainer.resume=auto) to continue from it."
                if latest
                else "No checkpoint was written yet; rerun to start over."
            )
        else:
            return None
        if self.health.stop is None:
            self.health.record_stop(step, reason)
        return RunStopped(f"run stopped during step {step}: {reason}. {advice}")

    def _retriever_advice(self) -> str:
        service = self.supervisor.service if self.supervisor is not None else None
        if service is None:
            return "Bring the retriever back"
        if service.owned:
            return f"The retrieval server this run started ({service.url}) did not come back: see retriever.log"
        return f"Bring the retriever at retriever.url={service.url} back (or point retriever.url at another one)"

    def _save_on_stop(self, step: int, reason: str) -> str:
        """Checkpoint the last applied update (the interrupted step's batch goes back to the loader)."""
        if self._pending is not None and "metrics" in self._pending:
            self._log(self._pending["metrics"], self.done_step)  # the update is applied; its validation was cut short
        # the interrupted step's batch and those generated ahead stay unused: save() stores the loader before them
        if self.done_step == 0:
            return "Nothing was trained yet, so there is no checkpoint to save."
        self.health.record_stop(step, reason)
        self.save(self.done_step)
        return f"Saved the checkpoint of step {self.done_step} ({self.ckpts.latest()})."

    # ---------------------------------------------------------------- the run
    def fit(self, progress=None) -> list[dict]:
        start = self.maybe_resume()
        self.done_step = start
        try:
            self._run(start, progress)
        except Exception as exc:
            stop = self._stopped(exc)
            if stop is None:
                raise
            logger.error("%s", stop)
            raise stop from exc
        finally:
            self.metrics.close()
        return self.history

    def _run(self, start: int, progress) -> None:
        cfg = self.cfg.trainer
        if start == 0 and cfg.val_before_train:
            with self._supervised(0):
                self._log(self.validate(), step=0)
        step = start
        while step < cfg.total_steps:
            step += 1
            with self._supervised(step):
                metrics = self.train_step(step)
            metrics.update(self._health_metrics())
            self.health.add_step(metrics)
            trips = self.watchdog.check(step, metrics)
            if trips:
                step = self.rollback(step, trips, metrics)
                continue
            self.done_step, self._pending = step, {"metrics": metrics}
            self.rollouts.applied()
            last = step == cfg.total_steps
            if last or (cfg.test_freq > 0 and step % cfg.test_freq == 0):
                with self._supervised(step):
                    metrics.update(self.validate())
            self._log(metrics, step)
            self._pending = None
            if last or (cfg.save_freq > 0 and step % cfg.save_freq == 0):
                self.save(step)
            if progress is not None:
                progress(step, metrics)

    def _health_metrics(self) -> dict[str, float]:
        out = self.supervisor.step_metrics() if self.supervisor is not None else {}
        out["health/rollbacks"] = float(len(self.health.rollbacks))
        for key, value in self._marks.items():  # counts of a rolled-back step add to this one's
            out[key] = out.get(key, 0.0) + value
        self._marks = {}
        return out

    def _log(self, metrics: dict, step: int) -> None:
        if metrics:
            self.metrics.log(metrics, step)
            self.history.append({"step": step, **metrics})

    def _sampling_seed(self, step: int) -> int:
        # rollout sampling is seeded per step, so a resumed run samples what an uninterrupted one would
        return self.cfg.seed * 1_000_003 + step


_ACTOR_PHASES = {f"timing/{k}_s" for k in ("old_log_prob", "ref", "values", "update_critic", "update_actor", "sync")}


def _worker_metrics(out: DataProto) -> dict[str, float]:
    return reduce_metrics(out.meta_info)
