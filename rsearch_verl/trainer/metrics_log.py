"""Metrics sinks for the trainer: console, `metrics.jsonl` in the run directory, and wandb.

Metric names are namespaced (`actor/pg_loss`, `rollout/searches_mean`, `timing/gen_s`, `val/em`). Every step
appends one JSON object with `step` to `metrics.jsonl` (flushed and fsynced, so a killed run loses at most the line
being written; a resumed run appends). wandb runs offline unless WANDB_API_KEY is set or WANDB_MODE says otherwise,
so nothing leaves the machine by default.

Usage:
    log = MetricsLogger(run_dir, loggers=["console", "jsonl", "wandb"], project="rsearch-verl", name="run", config={})
    log.log({"reward/mean": 0.3, "timing/step_s": 12.0}, step=3)
    log.close()
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

logger = logging.getLogger("rsearch_verl.metrics")

CONSOLE_KEYS = (
    "reward/mean",
    "val/em",
    "rollout/searches_mean",
    "rollout/response_len_mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "critic/vf_loss",
    "timing/step_s",
)


def _plain(value: Any) -> Any:
    """Turn tensors / numpy scalars into JSON numbers; NaN and inf become null (valid JSON)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    def __init__(self, run_dir: str, loggers: list[str], project: str, name: str, config: dict | None = None):
        unknown = set(loggers) - {"console", "jsonl", "wandb"}
        if unknown:
            raise ValueError(f"trainer.loggers: unknown {sorted(unknown)} (known: console, jsonl, wandb)")
        self.loggers = list(loggers)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a") if "jsonl" in loggers else None  # noqa: SIM115 - closed in close()
        self._wandb = None
        if "wandb" in loggers:
            # heavy/optional: wandb only when the wandb backend is on
            import wandb

            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self._wandb = wandb.init(project=project, name=name, config=config, dir=run_dir, mode=mode)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        if "console" in self.loggers:
            shown = " ".join(f"{k}={row[k]:.4g}" for k in CONSOLE_KEYS if isinstance(row.get(k), (int, float)))
            logger.info("step %d | %s", step, shown)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def truncate(self, after_step: int) -> None:
        """Drop the rows of steps after `after_step` (a resumed run re-does them), keeping the file open for append."""
        if self._file is not None:
            self._file.close()
        truncate_metrics(os.path.dirname(self.path), after_step)
        if self._file is not None:
            self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(run_dir: str) -> list[dict]:
    """All rows of a run's metrics.jsonl (a torn last line from a killed run is skipped)."""
    rows = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def truncate_metrics(run_dir: str, after_step: int) -> None:
    """Drop rows logged after `after_step` (a run killed after its last checkpoint logged steps that a resumed
    run will redo), rewriting the file atomically."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return
    kept = [row for row in read_metrics(run_dir) if row.get("step", 0) <= after_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
