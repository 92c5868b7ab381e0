"""Difficulty selection by rollout pass counts (R1-Searcher) and curriculum ordering (R-Search DAG)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from rsearch_verl.data.selection import (
    count_passes,
    curriculum_order,
    difficulty_level,
    main,
    select_by_level,
    select_by_pass_counts,
)


def _rows(n: int = 6) -> list[dict]:
    return [
        {
            "id": f"q{i}",
            "question": f"question {i} " + "word " * (n - i),
            "prompt": f"Question: {i}?",
            "data_source": "toy",
            "reward_model": {"style": "rule", "ground_truth": {"target": [str(i)]}},
            "extra_info": {"index": i, "split": "train", "question": f"question {i}", "hops": 1 + i % 3},
        }
        for i in range(n)
    ]


def _write_dump(path, passes: dict[str, int], n: int, key: str = "index") -> None:
    """A rollout dump in the line format of docs/architecture.md, question `qi` passing passes[qi] of n times."""
    with open(path, "w") as f:
        for qid, p in passes.items():
            for j in range(n):
                line = {"uid": f"u-{qid}", "prompt": f"P {qid}", "response": "r", "response_ids": [1],
                        "response_mask": [1], "reward": 1.0 if j < p else 0.0, "n_searches": 1,
                        "ground_truth": ["x"], "data_source": "toy"}  # fmt: skip
                if key == "index":
                    line["index"] = qid
                f.write(json.dumps(line) + "\n")


def test_difficulty_levels():
    assert difficulty_level(0, 16) == "unsolved"
    assert difficulty_level(1, 16) == "hard"
    assert difficulty_level(4, 16) == "medium"
    assert difficulty_level(8, 16) == "easy" and difficulty_level(16, 16) == "easy"
    with pytest.raises(ValueError):
        difficulty_level(5, 4)


def test_count_passes_reads_dump_dirs(tmp_path):
    _write_dump(tmp_path / "step_1.jsonl", {"q0": 0, "q1": 2}, n=4)
    _write_dump(tmp_path / "step_2.jsonl", {"q1": 1, "q2": 4}, n=4)
    counts = count_passes([str(tmp_path)])
    assert counts == {"q0": (0, 4), "q1": (3, 8), "q2": (4, 4)}
    partial = count_passes([str(tmp_path / "step_1.jsonl")], pass_threshold=0.5)
    assert partial == {"q0": (0, 4), "q1": (2, 4)}
    with pytest.raises(FileNotFoundError):
        count_passes([str(tmp_path / "nope")])


def test_dump_lines_without_index_fall_back_to_prompt(tmp_path):
    _write_dump(tmp_path / "d.jsonl", {"q0": 1}, n=2, key="prompt")
    assert count_passes([str(tmp_path / "d.jsonl")]) == {"P q0": (1, 2)}


def test_select_by_pass_counts_band():
    rows = _rows()
    counts = {"q0": (0, 8), "q1": (2, 8), "q2": (5, 8), "q3": (8, 8), "q4": 3}  # q5 never rolled out
    kept = select_by_pass_counts(rows, counts, n_rollouts=8, keep=(1, 5))
    assert [r["id"] for r in kept] == ["q1", "q2", "q4"]
    assert kept[0]["pass_count"] == 2 and kept[0]["pass_rate"] == 0.25
    assert kept[0]["reward_model"] == rows[1]["reward_model"]  # rows pass through otherwise unchanged
    # counts over a different number of rollouts are rescaled to the same pass rate
    assert [r["id"] for r in select_by_pass_counts(rows, {"q0": (4, 16)}, 8, (2, 2))] == ["q0"]
    with pytest.raises(ValueError, match="keep"):
        select_by_pass_counts(rows, counts, 8, (3, 9))


def test_select_by_level_r1_searcher_stages():
    rows = _rows()
    counts = {"q0": (0, 16), "q1": (2, 16), "q2": (5, 16), "q3": (12, 16), "q4": (4, 16), "q5": (1, 16)}
    assert [r["id"] for r in select_by_level(rows, counts, 16, ["medium"])] == ["q2", "q4"]
    assert [r["id"] for r in select_by_level(rows, counts, 16, ["medium", "hard"])] == ["q1", "q2", "q4", "q5"]
    with pytest.raises(ValueError, match="levels"):
        select_by_level(rows, counts, 16, ["trivial"])


def test_curriculum_order():
    rows = _rows()
    by_hops = curriculum_order(rows, "hops")
    assert [r["extra_info"]["hops"] for r in by_hops] == [1, 1, 2, 2, 3, 3]
    assert [r["id"] for r in by_hops] == ["q0", "q3", "q1", "q4", "q2", "q5"]  # stable within a level
    scored = [{**r, "pass_rate": p} for r, p in zip(rows, [0.1, 0.9, 0.5, 0.5, 0.0, 1.0], strict=True)]
    assert [r["id"] for r in curriculum_order(scored, "pass_rate")] == ["q5", "q1", "q2", "q3", "q0", "q4"]
    assert [r["id"] for r in curriculum_order(rows, "question_length")][0] == "q5"
    assert [r["id"] for r in curriculum_order(rows, lambda r: -int(r["id"][1:]))][0] == "q5"
    with pytest.raises(KeyError, match="dag_nodes"):
        curriculum_order(rows, "dag_nodes")


def test_cli_selects_orders_and_writes_parquet(tmp_path):
    pd.DataFrame(_rows()).to_parquet(tmp_path / "train.parquet", index=False)
    _write_dump(tmp_path / "step_1.jsonl", {"q0": 0, "q1": 2, "q2": 3, "q3": 4, "q4": 1, "q5": 2}, n=4)
    out = tmp_path / "stage1.parquet"
    main(["--rows", str(tmp_path / "train.parquet"), "--dumps", str(tmp_path / "step_1.jsonl"),
          "--n-rollouts", "4", "--keep", "1", "3", "--order", "hops", "--out", str(out)])  # fmt: skip
    got = pd.read_parquet(out)
    assert list(got["id"]) == ["q1", "q4", "q2", "q5"]
    assert list(got.iloc[0]["reward_model"]["ground_truth"]["target"]) == ["1"]
