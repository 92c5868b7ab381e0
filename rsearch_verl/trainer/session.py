"""Everything around the training loop for one run: the preflight (rsearch_verl/trainer/preflight.py: seconds, before
anything expensive), the run directory, data (rsearch_verl/trainer/data_sources.py), the tokenizer, the warm start, the
retrieval server, Ray, the worker groups, a progress bar and the final summary. What it resolves while starting goes
into a RunContext (rsearch_verl/run_context.py), from which the run's config is derived. Cleans up what it started,
even on errors. Secret env vars (rsearch_verl/secrets.py) reach the workers through Ray's runtime env.

Usage (what `rsearch_verl.main.run` does):
    with TrainingSession(cfg, run_dir) as session:
        summary = session.train()     # {"val/em_before": ..., "val/em_after": ..., "health": {"status": ...}, ...}

summary.json is written at the end, and also when the run stops early (`RunStopped`, re-raised), with the run's
health record (rsearch_verl/trainer/health/report.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os

import ray
from omegaconf import OmegaConf
from tqdm import tqdm

from rsearch_verl.config import RSearchConfig, public_dict
from rsearch_verl.data.dataset import PromptDataset
from rsearch_verl.log_setup import quiet_expected_warnings
from rsearch_verl.models import policy_tokenizer
from rsearch_verl.rollout.protocols import protocol_for
from rsearch_verl.run_context import RunContext, check_checkpoint_tokenizer
from rsearch_verl.search.service import RetrieverService
from rsearch_verl.search.supervisor import RetrieverSupervisor
from rsearch_verl.secrets import worker_secrets
from rsearch_verl.trainer.data_sources import load_run_data
from rsearch_verl.trainer.health import RunStopped
from rsearch_verl.trainer.preflight import check_hosts, preflight

logger = logging.getLogger(__name__)

RAY_ENV = {"TOKENIZERS_PARALLELISM": "false"}  # the driver's value if it has one, else this
# Passed to the workers only when the driver's environment sets them: forcing offline mode made a hub model the
# driver had not cached unloadable on the workers; with neither set, workers load exactly as the driver does.
INHERITED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def worker_env_vars(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The env_vars of the local Ray runtime env: RAY_ENV (driver values win) plus the INHERITED_ENV the driver has."""
    environ = os.environ if environ is None else environ
    env = {k: environ.get(k, v) for k, v in RAY_ENV.items()}
    env.update({k: environ[k] for k in INHERITED_ENV if k in environ})
    return env


def init_ray(cfg: RSearchConfig) -> bool:
    """Connect to the cluster in trainer.ray_address / RAY_ADDRESS, or start a local one. True if we started it."""

    if ray.is_initialized():
        return False
    quiet_expected_warnings(cpu=cfg.trainer.device == "cpu")
    # workers do not inherit the driver's environment on a cluster: the secrets travel in the runtime env (values
    # never logged, only their names)
    secrets = worker_secrets(cfg)
    if secrets:
        logger.info("forwarding %s to the Ray workers", ", ".join(sorted(secrets)))
    address = cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        # inside `ray job submit` the job's runtime env (launch/runtime_env.yaml plus the secrets launch/submit.sh
        # forwards) applies to every worker, and repeating its keys here would conflict; a driver started by hand
        # against a running cluster has no job runtime env, so it passes the secrets itself
        in_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
        runtime_env = {"env_vars": secrets} if secrets and not in_job else None
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return True
    runtime_env = {"env_vars": {**worker_env_vars(), **secrets}}
    num_cpus = cfg.trainer.ray_num_cpus or max(2, os.cpu_count() or 2)
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=512 << 20,
        runtime_env=runtime_env,
        log_to_driver=True,
    )
    return True


class TrainingSession:
    def __init__(self, cfg: RSearchConfig, run_dir: str):
        self.recipe_cfg, self.run_dir = cfg, os.path.abspath(run_dir)  # the recipe's validated config, as given
        self.run_cfg: RSearchConfig | None = None  # the run's: the recipe + what it resolved while starting (_prepare)
        self.protocol = protocol_for(cfg)  # the run's protocol, the one instance of the driver: handed down from here
        self.context = RunContext()  # what the run resolved while starting (tokenizer, warm start, retriever URL)
        self.warm_start_report: dict | None = None  # the toy warm start's skill probes (rsearch_verl/toy/warm_start.py)
        self.retriever: RetrieverService | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> TrainingSession:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _prepare(self):
        recipe = self.recipe_cfg
        preflight(recipe, self.run_dir)  # seconds: before the data, the warm start and the workers
        data = load_run_data(recipe, self.protocol)
        ctx = RunContext(tokenizer_path=data.tokenizer_path)
        # the recipe with the toy world's tokenizer: what the warm start is trained (and cached) for and what the
        # policy's tokenizer is loaded from; the run's config (below) adds the warm start and the retriever's URL
        with_tokenizer = ctx.apply(recipe)
        if recipe.model.sft_checkpoint == "auto":  # the toy world's warm start, built once and cached
            # heavy: the warm start (SFT, HF engine) only when the recipe asks for it
            from rsearch_verl.toy.warm_start import read_report, warm_start

            ctx = dataclasses.replace(ctx, sft_checkpoint=warm_start(with_tokenizer))
            self.warm_start_report = read_report(ctx.sft_checkpoint)
        check_checkpoint_tokenizer(ctx.tokenizer_path, ctx.sft_checkpoint or with_tokenizer.model.sft_checkpoint)
        tokenizer = policy_tokenizer(with_tokenizer)

        def prompts(rows: list[dict], name: str) -> PromptDataset:
            return PromptDataset(rows, tokenizer, recipe.data.max_prompt_length, name=name, protocol=self.protocol)

        train, val = prompts(data.train_rows, "train"), (prompts(data.val_rows, "val") if data.val_rows else None)
        self.retriever = RetrieverService(
            recipe.retriever, data.corpus, data.index_dir, log_path=os.path.join(self.run_dir, "retriever.log")
        )
        ctx = dataclasses.replace(ctx, retriever_url=self._stack.enter_context(self.retriever))
        self.context = ctx.published(self.run_dir)  # the workers' hosts see the run dir, not our cache
        self.run_cfg = self.context.apply(recipe)
        _write_config(self.run_cfg, self.run_dir)
        return tokenizer, train, val

    def train(self) -> dict:
        # heavy: the trainer and the worker classes (pandas and more) load when training starts
        from rsearch_verl.trainer.loop import Trainer
        from rsearch_verl.workers.placement import build_worker_groups

        tokenizer, train, val = self._prepare()
        cfg = self.run_cfg
        if init_ray(cfg):
            self._stack.callback(ray.shutdown)
        check_hosts(cfg)  # a multi-host cluster: every host sees the run dir, the paths and the retriever
        workers = build_worker_groups(cfg)
        # replay-only: no retriever to watch (rsearch_verl/search/service.py)
        supervisor = RetrieverSupervisor(self.retriever, cfg.retriever) if self.retriever.needed else None
        trainer = Trainer(cfg, self.run_dir, workers, train, val, tokenizer, self.protocol, supervisor=supervisor)
        try:
            history = trainer.fit(progress=_progress_bar(cfg.trainer.total_steps, self._stack))
        except RunStopped:
            self._summarise(trainer.history, trainer.health.summary(), trainer.health.cost.summary())
            raise
        return self._summarise(history, trainer.health.summary(), trainer.health.cost.summary())

    def _summarise(self, history: list[dict], health: dict, search_cost: dict) -> dict:
        vals = [row for row in history if "val/em" in row]
        summary = {"run_dir": self.run_dir, "steps": self.recipe_cfg.trainer.total_steps}
        if vals:
            summary.update(
                {
                    "val/em_before": vals[0]["val/em"],
                    "val/em_after": vals[-1]["val/em"],
                    "val/searches_mean_before": vals[0].get("val/searches_mean"),
                    "val/searches_mean_after": vals[-1].get("val/searches_mean"),
                }
            )
            if "val/opens_mean" in vals[0]:  # runs with the open tool (rollout.tools)
                summary["val/opens_mean_before"] = vals[0]["val/opens_mean"]
                summary["val/opens_mean_after"] = vals[-1].get("val/opens_mean")
        if self.warm_start_report is not None:
            report = self.warm_start_report
            summary["warm_start"] = {k: report[k] for k in ("seed", "epochs", "greedy")}
            summary["warm_start"]["probe"] = report["probes"][-1]
        summary["health"] = health
        summary["search_cost"] = search_cost  # seconds in search calls and calls per source (health/report.py)
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        logger.info("summary: %s", json.dumps(summary))
        return summary


def _write_config(cfg: RSearchConfig, run_dir: str) -> None:
    OmegaConf.save(OmegaConf.create(public_dict(cfg)), os.path.join(run_dir, "config.yaml"))


def _progress_bar(total: int, stack: contextlib.ExitStack):
    bar = stack.enter_context(tqdm(total=total, desc="train", unit="step", dynamic_ncols=True))

    def update(step: int, metrics: dict) -> None:
        bar.n = step
        bar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.3f}" for k in ("reward/mean", "val/em") if k in metrics})
        bar.refresh()

    return update
