"""Learning-curve PNGs for a run directory: reward, validation EM, response length, searches, KL.

Reads `<run_dir>/metrics.jsonl` (the run-directory contract of docs/architecture.md) and writes
`<run_dir>/plots/<name>.png` with matplotlib's Agg backend (no display needed). A plot whose metric never appears
in the file is skipped and the skip is logged, so a run without validation or without KL still gets the other curves.

    python -m rsearch_verl.eval.plots RUN_DIR          # CLI; prints the written paths
    paths = make_plots(run_dir)                        # what rsearch_verl.main.run calls after the training run
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from dataclasses import dataclass

from rsearch_verl.trainer.metrics_log import read_metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlotSpec:
    name: str  # file stem under plots/
    title: str
    ylabel: str
    keys: tuple[str, ...]  # metric names drawn as separate lines when present


# KL is logged under one of several names depending on where it enters (reward penalty, loss term, or the PPO
# ratio diagnostic); all present ones are drawn so runs with KL-in-reward and KL-as-loss read the same way.
PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("reward", "Training reward", "mean reward", ("reward/mean",)),
    PlotSpec("val_em", "Validation exact match", "EM", ("val/em",)),
    PlotSpec("response_len", "Response length", "tokens", ("rollout/response_len_mean",)),
    PlotSpec("searches", "Searches per trajectory", "searches", ("rollout/searches_mean",)),
    PlotSpec("kl", "KL to reference", "KL", ("actor/reward_kl", "actor/kl_loss", "actor/ppo_kl")),
)


def metric_series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`, sorted by step; non-finite / null values dropped; a step logged twice (a
    resumed run re-logging a step) keeps its last value."""
    by_step: dict[int, float] = {}
    for row in rows:
        value = row.get(key)  # a metric is absent from steps that did not compute it (val/em)
        if "step" not in row or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if math.isfinite(value):
            by_step[int(row["step"])] = float(value)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _draw(spec: PlotSpec, series: dict[str, tuple[list[int], list[float]]], path: str) -> None:
    # heavy: matplotlib only when plots are drawn
    import matplotlib

    matplotlib.use("Agg")  # headless: the trainer runs on machines without a display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    try:
        for key, (steps, values) in series.items():
            # A single point (e.g. val/em of a 1-step run) is invisible as a line; markers keep it visible.
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=4, label=key)
        ax.set_title(spec.title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_ylabel(spec.ylabel)
        ax.grid(True, alpha=0.3)
        if len(series) > 1:
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def make_plots(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Write one PNG per metric group present in `<run_dir>/metrics.jsonl`; returns the written paths.

    `out_dir` defaults to `<run_dir>/plots`. Raises FileNotFoundError when the run has no metrics.jsonl.
    """
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics_path):
        raise FileNotFoundError(f"no metrics.jsonl in run directory {run_dir!r}")
    rows = read_metrics(run_dir)
    out_dir = out_dir or os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for spec in PLOTS:
        series = {}
        for key in spec.keys:
            steps, values = metric_series(rows, key)
            if steps:
                series[key] = (steps, values)
        if not series:
            logger.info("plots: skipping %s, none of %s in %s", spec.name, ", ".join(spec.keys), metrics_path)
            continue
        path = os.path.join(out_dir, f"{spec.name}.png")
        _draw(spec, series, path)
        written.append(path)
    logger.info("plots: wrote %d plot(s) to %s", len(written), out_dir)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rsearch_verl.eval.plots", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="output directory (default: RUN_DIR/plots)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        paths = make_plots(args.run_dir, args.out)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    for path in paths:
        print(path)  # noqa: T201 - CLI output
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
