"""Hydra entry point of rsearch-verl: compose a recipe, start (or connect to) Ray and the retrieval server,
build the worker groups, train, validate and write the run directory.

    python -m rsearch_verl.main +recipe=search_r1_ppo                        # the embedded toy world, CPU
    python -m rsearch_verl.main +recipe=search_r1_grpo trainer.total_steps=2 trainer.run_dir=outputs/try
    python -m rsearch_verl.main +recipe=search_r1_ppo model=qwen2_5_3b_instruct data=nq_hotpotqa \
        retriever=wiki18_e5 rollout=vllm trainer=gpu_1x8                       # real scale
    ray job submit --working-dir . -- python -m rsearch_verl.main +recipe=...  # launch/submit.sh wraps this

The run directory (`trainer.run_dir`, default outputs/<recipe>/<timestamp>) holds config.yaml, metrics.jsonl,
rollouts/step_<N>.jsonl, checkpoints/step_<N>/, plots/ and summary.json (with the run's health). Pass the same
`trainer.run_dir` again to resume (`trainer.resume=auto` is the default).

Exit codes: 0 done (summary.json `health.status` is "ok" or "degraded"); 3 stopped early with a message saying why and
what to do (a retriever that did not come back, a dead Ray worker, the health watchdog's rollbacks used up; see
docs/health.md); anything else is a crash.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from rsearch_verl.config import ConfigError, RSearchConfig, check_override_keys, from_omegaconf, register_schema
from rsearch_verl.log_setup import setup_logging
from rsearch_verl.search.service import RetrieverError
from rsearch_verl.trainer.health import STOP_EXIT_CODE, RunStopped

logger = logging.getLogger("rsearch_verl")


def run(cfg: RSearchConfig, run_dir: str) -> dict:
    """Train `cfg` into `run_dir`, then draw its learning curves (`plots/`); return the final summary (also logged)."""
    # imported here: torch, Ray and matplotlib load when a run starts, not for `--help` or a rejected override
    from rsearch_verl.eval.plots import make_plots
    from rsearch_verl.trainer.session import TrainingSession

    with TrainingSession(cfg, run_dir) as session:
        summary = session.train()
    logger.info("plots: %s", ", ".join(make_plots(run_dir)))
    return summary


register_schema()
CONFIG_EXIT_CODE = 2  # a config mistake (as argparse exits on a bad flag)
RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")


def check_command_line(argv: list[str]) -> None:
    """Exit 2 with one line when an override names a key the schema lacks, before Hydra composes: Hydra would
    suggest `+key=value` for it, and `--cfg job` prints a config without running `main`, so without this check
    `+trainer.total_step=2 --cfg job` looked fine."""
    groups = tuple(name for name in os.listdir(RECIPES) if os.path.isdir(os.path.join(RECIPES, name)))
    try:
        check_override_keys(argv, groups)
    except ConfigError as exc:
        print(f"invalid override: {exc}", file=sys.stderr)  # noqa: T201 - before logging is set up
        sys.exit(CONFIG_EXIT_CODE)


@hydra.main(config_path="../recipes", config_name="config", version_base="1.3")
def main(oc_cfg: DictConfig) -> None:
    setup_logging()

    try:
        cfg = from_omegaconf(oc_cfg)
    except ConfigError as exc:  # one line naming the key, not a traceback
        logger.error("invalid config: %s", exc)
        sys.exit(CONFIG_EXIT_CODE)
    run_dir = cfg.trainer.run_dir or HydraConfig.get().runtime.output_dir
    try:
        run(cfg, run_dir)
    except (RunStopped, RetrieverError) as exc:
        logger.error("%s", exc)
        sys.exit(STOP_EXIT_CODE)


if __name__ == "__main__":
    check_command_line(sys.argv[1:])
    main()
