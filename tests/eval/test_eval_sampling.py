"""Avg@k / Pass@k (rsearch_verl/eval/sampling.py): the unbiased estimator against brute force over k-subsets, and
the evaluation table / results with k samples per question and with a judge column."""

from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace

import pytest

from rsearch_verl.config import RSearchConfig
from rsearch_verl.eval.evaluate import build_parser, check_eval_options, format_table, summarise
from rsearch_verl.eval.sampling import expected_max_at_k, group_by_question, pass_at_k, sample_metrics


def brute_force(scores: list[float], k: int) -> float:
    subsets = list(itertools.combinations(scores, k))
    return sum(max(s) for s in subsets) / len(subsets)


def test_pass_at_k_values():
    assert pass_at_k(8, 3, 4) == pytest.approx(1 - math.comb(5, 4) / math.comb(8, 4))
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0  # n == k: any correct
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 is the fraction correct
    assert pass_at_k(5, 4, 2) == 1.0  # n - c < k: every pair holds a correct one
    for bad in ((3, 4, 1), (3, 1, 4), (3, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_expected_max_matches_brute_force_and_pass_at_k():
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(1, 7)
        scores = [rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(n)]
        for k in range(1, n + 1):
            assert expected_max_at_k(scores, k) == pytest.approx(brute_force(scores, k))
        binary = [float(s >= 0.5) for s in scores]
        for k in range(1, n + 1):
            assert expected_max_at_k(binary, k) == pytest.approx(pass_at_k(n, int(sum(binary)), k))
    assert expected_max_at_k([0.2, 0.9, 0.5], 3) == pytest.approx(0.9)  # n == k: the max
    with pytest.raises(ValueError):
        expected_max_at_k([1.0], 2)


def _rows(samples: dict[str, list[tuple[float, float]]]) -> list[dict]:
    """Rows as eval/evaluate.py writes them, k per question, interleaved as the rollout repeats prompts."""
    rows = []
    for qid, scores in samples.items():
        for em, f1 in scores:
            rows.append({"id": qid, "em": em, "f1": f1, "cover_em": em, "searches": 1, "reward": em})
    return rows


def test_sample_metrics_avg_and_pass():
    rows = _rows({"a": [(1, 1.0), (0, 0.5), (0, 0.0), (0, 0.0)], "b": [(0, 0.0)] * 4, "c": [(1, 1.0)] * 4})
    assert [len(g) for g in group_by_question(rows)] == [4, 4, 4]
    got = sample_metrics(rows, ("em", "f1"), ks=(1, 2, 4))
    assert got["avg@4/em"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert got["pass@1/em"] == pytest.approx(got["avg@4/em"])  # pass@1 == avg
    assert got["pass@4/em"] == pytest.approx(2 / 3)  # a and c have a correct sample
    assert got["pass@2/em"] == pytest.approx((pass_at_k(4, 1, 2) + 0 + 1) / 3)
    assert got["pass@4/f1"] == pytest.approx((1.0 + 0 + 1) / 3)
    with pytest.raises(ValueError, match="only 4 samples per question"):
        sample_metrics(rows, ("em",), ks=(5,))


def test_table_with_samples_and_judge():
    rows = _rows({"a": [(1, 1.0), (0, 0.0)], "b": [(0, 0.0), (0, 0.0)]})
    for row, (verdict, err) in zip(rows, [(1, 0), (1, 0), (0, 1), (0, 0)], strict=True):
        row.update(judge=float(verdict), judge_error=float(err))
    table = summarise({"bcp": rows, "other": _rows({"x": [(1, 1.0), (1, 1.0)]})})
    assert table["bcp"]["n"] == 4 and table["bcp"]["judge"] == pytest.approx(0.5)
    assert table["bcp"]["avg@2/judge"] == pytest.approx(0.5) and table["bcp"]["pass@2/judge"] == pytest.approx(0.5)
    assert table["bcp"]["pass@2/em"] == pytest.approx(0.5) and table["bcp"]["judge_errors"] == 1
    assert "judge" not in table["other"] and table["other"]["pass@2/em"] == 1.0
    # the average covers the columns every dataset has
    assert table["average"]["pass@2/em"] == pytest.approx(0.75) and "judge" not in table["average"]
    text = format_table(table)
    header = text.splitlines()[0].split()
    assert header[:7] == ["dataset", "n", "em", "f1", "cover_em", "searches", "reward"]
    assert {"judge", "avg@2/em", "pass@2/em", "pass@2/judge", "judge_errors"} <= set(header)
    bcp = next(line.split() for line in text.splitlines() if line.startswith("bcp"))
    assert bcp[header.index("judge_errors")] == "1"
    assert "nan" in next(line for line in text.splitlines() if line.startswith("other"))  # no judge column there
    # one sample per question: the table the papers print, unchanged
    single = summarise({"nq": _rows({"a": [(1, 1.0)], "b": [(0, 0.5)]})})
    assert list(single["nq"]) == ["n", "em", "f1", "cover_em", "searches", "reward"]


def test_options_refused_before_any_work():
    args = build_parser().parse_args(
        ["--checkpoint", "tiny", "--toy-world", "--out", "o", "--pass-k", "1,4", "--judge"]
    )
    assert args.pass_k == (1, 4) and args.judge
    cfg = RSearchConfig()
    with pytest.raises(ValueError, match=r"reward.judge.url must be set for python -m rsearch_verl.eval --judge"):
        check_eval_options(args, cfg)
    with pytest.raises(ValueError, match=r"--pass-k \[4\]: each k must be in 1..rollout.val_n=1"):
        check_eval_options(SimpleNamespace(judge=False, pass_k=(1, 4)), cfg)
    check_eval_options(SimpleNamespace(judge=False, pass_k=()), cfg)
