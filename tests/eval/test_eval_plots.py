"""Tests of rsearch_verl.eval.plots: learning-curve PNGs from a run's metrics.jsonl (real matplotlib, Agg).

.venv/bin/pytest -q tests/eval/test_eval_plots.py
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys

import pytest
from PIL import Image

from rsearch_verl.eval.plots import PLOTS, make_plots, metric_series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_NAMES = {spec.name for spec in PLOTS}


def _write_metrics(run_dir, rows, torn_tail: str = "") -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write(torn_tail)


def _full_rows(n: int = 12) -> list[dict]:
    rows = []
    for step in range(n):
        row = {
            "step": step,
            "reward/mean": 0.1 + 0.05 * step,
            "rollout/response_len_mean": 200 - 3 * step,
            "rollout/searches_mean": 0.5 + 0.1 * step,
            "actor/reward_kl": 0.001 * step,
            "actor/kl_loss": 0.002 * step,
            "timing/step_s": 1.5,
        }
        if step % 4 == 0:  # validation only every test_freq steps, as the trainer logs it
            row["val/em"] = 0.2 + 0.02 * step
        rows.append(row)
    return rows


def _assert_png(path: str) -> Image.Image:
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    img = Image.open(path)
    img.load()  # decodes the whole stream: a truncated file raises here
    assert img.format == "PNG"
    return img.convert("RGB")


def test_all_plots_written_as_valid_pngs(tmp_path):
    run_dir = str(tmp_path / "run")
    _write_metrics(run_dir, _full_rows())
    paths = make_plots(run_dir)
    assert {os.path.splitext(os.path.basename(p))[0] for p in paths} == ALL_NAMES
    for path in paths:
        assert os.path.dirname(path) == os.path.join(run_dir, "plots")
        img = _assert_png(path)
        assert img.size == (600, 400)
        # a drawn curve, axes and text: many distinct colours, not a blank canvas
        assert len(img.getcolors(maxcolors=1 << 16) or range(1 << 16)) > 20


def test_missing_metrics_skip_their_plot_with_a_log_line(tmp_path, caplog):
    run_dir = str(tmp_path / "run")
    rows = [{"step": s, "reward/mean": s / 10, "rollout/response_len_mean": 100 + s} for s in range(5)]
    _write_metrics(run_dir, rows, torn_tail='{"step": 5, "reward/me')  # a killed run's torn last line
    with caplog.at_level(logging.INFO, logger="rsearch_verl.eval.plots"):
        paths = make_plots(run_dir)
    assert sorted(os.path.basename(p) for p in paths) == ["response_len.png", "reward.png"]
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 3
    assert any("val/em" in m for m in skipped) and any("actor/ppo_kl" in m for m in skipped)


def test_kl_plot_draws_whichever_kl_key_exists(tmp_path):
    run_dir = str(tmp_path / "run")
    _write_metrics(run_dir, [{"step": s, "actor/ppo_kl": 0.01 * s} for s in range(3)])
    paths = make_plots(run_dir, out_dir=str(tmp_path / "elsewhere"))
    assert paths == [str(tmp_path / "elsewhere" / "kl.png")]
    _assert_png(paths[0])


def test_metric_series_sorts_dedups_and_drops_non_finite():
    rows = [
        {"step": 2, "k": 2.0},
        {"step": 1, "k": 1.0},
        {"step": 3, "k": math.nan},
        {"step": 4, "k": None},
        {"step": 5, "k": True},  # a flag, not a measurement
        {"k": 9.0},  # no step
        {"step": 2, "k": 2.5},  # a resumed run re-logged step 2: last value wins
    ]
    assert metric_series(rows, "k") == ([1, 2], [1.0, 2.5])
    assert metric_series(rows, "absent") == ([], [])


def test_no_metrics_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        make_plots(str(tmp_path))


def test_cli_writes_plots_and_prints_paths(tmp_path):
    run_dir = str(tmp_path / "run")
    _write_metrics(run_dir, _full_rows(4))
    proc = subprocess.run(
        [sys.executable, "-m", "rsearch_verl.eval.plots", run_dir], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.split()
    assert len(printed) == len(ALL_NAMES)
    for path in printed:
        _assert_png(path)
    bad = subprocess.run(
        [sys.executable, "-m", "rsearch_verl.eval.plots", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "metrics.jsonl" in bad.stderr
