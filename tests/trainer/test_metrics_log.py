"""metrics.jsonl sink: one JSON row per step, NaN becomes null, truncation on resume, torn lines skipped."""

import json
import math

import torch

from rsearch_verl.trainer.metrics_log import MetricsLogger, read_metrics, truncate_metrics


def test_rows_and_truncation(tmp_path):
    log = MetricsLogger(str(tmp_path), ["jsonl", "console"], project="p", name="n")
    for step in range(4):
        log.log({"reward/mean": torch.tensor(step / 2), "actor/pg_loss": math.nan}, step=step)
    log.close()
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[3]["reward/mean"] == 1.5 and rows[3]["actor/pg_loss"] is None
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rew')  # a run killed mid-line
    assert len(read_metrics(str(tmp_path))) == 4
    truncate_metrics(str(tmp_path), after_step=1)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1]
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line)


def test_unknown_logger_is_an_error(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="unknown"):
        MetricsLogger(str(tmp_path), ["jsonl", "tensorboardx"], project="p", name="n")
