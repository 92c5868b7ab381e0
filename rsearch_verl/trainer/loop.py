"""The training loop: the single controller that drives the worker groups one step at a time.

`Trainer.train_step` is the step of docs/architecture.md, one commented call per phase:
generate (search-aware rollout) → reward → old log-probs → reference log-probs → values → advantages →
critic update → actor update → weight sync → rollout dump. `fit` adds validation (before the first update, every
`trainer.test_freq` steps and at the end), metrics, atomic checkpoints every `trainer.save_freq` steps and at the
end, and `trainer.resume=auto` (continue from the newest complete checkpoint).

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
from rsearch_verl.config import RSearchConfig, to_dict
from rsearch_verl.data.dataset import PromptDataset, PromptLoader
from rsearch_verl.rollout.dump import write_rollout_dump
from rsearch_verl.trainer import phases
from rsearch_verl.trainer.checkpoint import CheckpointManager
from rsearch_verl.trainer.logging import MetricsLogger
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
    ):
        self.cfg, self.run_dir, self.wg, self.tokenizer = cfg, run_dir, workers, tokenizer
        self.loader = PromptLoader(train_data, cfg.data.train_batch_size, seed=cfg.seed, shuffle=cfg.data.shuffle)
        self.val_data = val_data
        self.ckpts = CheckpointManager(run_dir, max_to_keep=cfg.trainer.max_ckpt_to_keep)
        self.metrics = MetricsLogger(
            run_dir,
            cfg.trainer.loggers,
            project=cfg.trainer.project_name,
            name=cfg.trainer.experiment_name or os.path.basename(run_dir),
            config=to_dict(cfg),
        )
        self.history: list[dict] = []

    # ---------------------------------------------------------------- one step
    def train_step(self, step: int) -> dict[str, float]:
        cfg, wg, timing = self.cfg, self.wg, {}
        batch = self.loader.next_batch()
        batch.meta_info.update(validate=False, seed=self._sampling_seed(step))
        with timed(timing, "step"):
            # 1. rollout: multi-turn generation with search; response_mask is 0 on inserted observations
            with timed(timing, "gen"):
                batch = wg.rollout.generate_sequences(batch)
            metrics = {**batch.meta_info.pop("metrics", {}), **phases.rollout_metrics(batch)}
            # the one place that decides which response tokens any loss sees (observations masked or not)
            batch.batch["loss_mask"] = batch_keys.loss_mask(batch.batch, cfg.algorithm.mask_observations)
            batch.meta_info["temperature"] = cfg.rollout.temperature  # every log-prob below uses logits / T
            # 2. rewards from the recipe's reward function (rule-based or judged)
            with timed(timing, "reward"):
                batch, reward_metrics = phases.reward_phase(batch, cfg)
            # 3. log-probs of the sampled tokens under the policy that generated them
            with timed(timing, "old_log_prob"):
                batch = batch.union(wg.actor.compute_log_prob(batch))
            metrics.update(phases.rollout_logprob_gap(batch))  # checks the last weight sync
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
            # 7. critic update
            if cfg.use_critic:
                with timed(timing, "update_critic"):
                    metrics.update(_worker_metrics(wg.critic.update_critic(batch)))
            # 8. actor update
            with timed(timing, "update_actor"):
                metrics.update(_worker_metrics(wg.actor.update_actor(batch)))
            # 9. push the new weights into the rollout engines
            with timed(timing, "sync"):
                wg.sync_rollout_weights()
        # 10. rollout dump for inspection (viewer, debugging)
        if cfg.trainer.dump_rollouts:
            path = os.path.join(self.run_dir, "rollouts", f"step_{step}.jsonl")
            write_rollout_dump(path, batch, self.tokenizer)
        return {**metrics, **reward_metrics, **adv_metrics, **timing}

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
            batch.meta_info.update(validate=True, seed=self.cfg.seed)
            batch = self.wg.rollout.generate_sequences(batch)
            batch.meta_info.pop("metrics", None)
            batch, _ = phases.reward_phase(batch, self.cfg)
            results.append(DataProto(non_tensor_batch=batch.non_tensor_batch))  # widths differ between batches
        return phases.validation_metrics(DataProto.concat(results))

    # ---------------------------------------------------------------- checkpoints
    def save(self, step: int) -> None:
        with self.ckpts.writing(step) as tmp:
            self.wg.actor.save_checkpoint(os.path.join(tmp, "actor"))
            if self.wg.critic is not None:
                self.wg.critic.save_checkpoint(os.path.join(tmp, "critic"))
            self.ckpts.write_trainer_state(tmp, {"step": step, "loader": self.loader.state_dict()})

    def maybe_resume(self) -> int:
        """Load the checkpoint `trainer.resume` points at; return the step it finished (0 for a fresh run)."""
        self.ckpts.sweep_incomplete()
        path = self.ckpts.resolve(self.cfg.trainer.resume)
        if path is None:
            return 0
        logger.info("resuming from %s", path)
        self.wg.actor.load_checkpoint(os.path.join(path, "actor"))
        if self.wg.critic is not None:
            self.wg.critic.load_checkpoint(os.path.join(path, "critic"))
        state = self.ckpts.read_trainer_state(path)
        self.loader.load_state_dict(state["loader"])
        self.wg.sync_rollout_weights()
        self.metrics.truncate(after_step=state["step"])
        return int(state["step"])

    # ---------------------------------------------------------------- the run
    def fit(self, progress=None) -> list[dict]:
        cfg = self.cfg.trainer
        start = self.maybe_resume()
        if start == 0 and cfg.val_before_train:
            self._log(self.validate(), step=0)
        for step in range(start + 1, cfg.total_steps + 1):
            metrics = self.train_step(step)
            last = step == cfg.total_steps
            if last or (cfg.test_freq > 0 and step % cfg.test_freq == 0):
                metrics.update(self.validate())
            self._log(metrics, step)
            if last or (cfg.save_freq > 0 and step % cfg.save_freq == 0):
                self.save(step)
            if progress is not None:
                progress(step, metrics)
        self.metrics.close()
        return self.history

    def _log(self, metrics: dict, step: int) -> None:
        if metrics:
            self.metrics.log(metrics, step)
            self.history.append({"step": step, **metrics})

    def _sampling_seed(self, step: int) -> int:
        # rollout sampling is seeded per step, so a resumed run samples what an uninterrupted one would
        return self.cfg.seed * 1_000_003 + step


def _worker_metrics(out: DataProto) -> dict[str, float]:
    return reduce_metrics(out.meta_info)
