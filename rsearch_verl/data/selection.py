"""Training-data selection by difficulty (R1-Searcher) and curriculum ordering (R-Search's NL-DAG paper).

Difficulty comes from rollouts: sample each question N times with a policy (e.g. a run with `rollout.n=N`
and `trainer.dump_rollouts=true`, or the evaluation CLI), count the passes (reward >= a threshold) per
question, then keep the questions whose pass count lies in a band. R1-Searcher trains stage 1 on "medium"
questions and stage 2 on medium + hard ones; `difficulty_level` names the bands by pass rate.
Curriculum ordering sorts rows from easy to hard by a key (hops, pass rate, DAG nodes, ...), stably.

Rollout dumps are JSONL lines of the dump contract (docs/architecture.md); the question is identified by `index`
(the prompt row's id) when the line carries it, else by `question`, else by the rendered `prompt` text.

Usage:
    counts = count_passes(["run/rollouts"], pass_threshold=1.0)   # {question key: (passes, rollouts)}
    kept = select_by_pass_counts(rows, counts, n_rollouts=16, keep=(1, 8))
    ordered = curriculum_order(kept, "hops")
CLI:
    python -m rsearch_verl.data.selection --rows train.parquet --dumps run/rollouts --n-rollouts 16 \
        --keep 1 8 --order hops --out train_stage1.parquet
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger(__name__)

LEVELS = ("unsolved", "hard", "medium", "easy")
KEY_FIELDS = ("index", "question", "prompt")  # how a dump line names its question, most specific first


def _dump_files(paths: Iterable[str]) -> list[str]:
    files: list[str] = []
    for p in paths:
        files += sorted(glob.glob(os.path.join(p, "*.jsonl"))) if os.path.isdir(p) else [p]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing or not files:
        raise FileNotFoundError(f"rollout dumps: no JSONL files at {list(paths)} (missing: {missing})")
    return files


def question_key(line: dict) -> str:
    for field in KEY_FIELDS:
        if line.get(field) not in (None, ""):
            return str(line[field])
    raise ValueError(f"rollout dump line names no question (needs one of {KEY_FIELDS}): keys {sorted(line)}")


def count_passes(paths: Iterable[str], pass_threshold: float = 1.0) -> dict[str, tuple[int, int]]:
    """{question key: (passes, rollouts)} over rollout dump files / directories of `*.jsonl`."""
    counts: dict[str, list[int]] = {}
    for path in _dump_files(paths):
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rec = json.loads(line)
                if "reward" not in rec:
                    raise ValueError(f"{path}:{n}: rollout dump line without 'reward'")
                c = counts.setdefault(question_key(rec), [0, 0])
                c[0] += float(rec["reward"]) >= pass_threshold
                c[1] += 1
    return {k: (p, t) for k, (p, t) in counts.items()}


def difficulty_level(passes: int, n_rollouts: int, easy: float = 0.5, hard: float = 0.25) -> str:
    """'easy' (pass rate >= easy), 'medium' (>= hard), 'hard' (> 0) or 'unsolved' (no pass)."""
    if n_rollouts <= 0 or not 0 <= passes <= n_rollouts:
        raise ValueError(f"difficulty_level: {passes} passes out of {n_rollouts} rollouts")
    rate = passes / n_rollouts
    if passes == 0:
        return "unsolved"
    return "easy" if rate >= easy else "medium" if rate >= hard else "hard"


def row_key(row: dict) -> str:
    """The id a prompt row is known by in rollout dumps (its `id`, as PromptDataset passes it on as `index`)."""
    if "id" in row:
        return str(row["id"])
    extra = row.get("extra_info") or {}
    if "index" in extra:
        return str(extra["index"])
    raise ValueError(f"row without 'id' or extra_info.index: keys {sorted(row)}")


def _lookup(row: dict, pass_counts: dict[str, Any]) -> Any:
    for key in (row_key(row), row.get("question")):
        if key is not None and str(key) in pass_counts:
            return pass_counts[str(key)]
    return None


def _passes(value: Any, n_rollouts: int) -> int:
    passes, total = value if isinstance(value, tuple | list) else (value, n_rollouts)
    if total != n_rollouts:
        # a question sampled a different number of times is rescaled so bands mean the same pass rate
        passes = round(passes * n_rollouts / total) if total else 0
    return int(passes)


def select_by_pass_counts(
    rows: list[dict], pass_counts: dict[str, Any], n_rollouts: int, keep: tuple[int, int]
) -> list[dict]:
    """Rows whose pass count over `n_rollouts` lies in `keep` = (lo, hi), inclusive. `pass_counts` maps a row's
    id (or question) to passes, or to (passes, rollouts) as `count_passes` returns. Rows without a count are
    dropped (logged). Each kept row gets `pass_count` and `pass_rate` fields."""
    lo, hi = keep
    if not 0 <= lo <= hi <= n_rollouts:
        raise ValueError(f"keep={keep}: need 0 <= lo <= hi <= n_rollouts={n_rollouts}")
    kept, unseen = [], 0
    for row in rows:
        value = _lookup(row, pass_counts)
        if value is None:
            unseen += 1
            continue
        passes = _passes(value, n_rollouts)
        if lo <= passes <= hi:
            kept.append({**row, "pass_count": passes, "pass_rate": passes / n_rollouts})
    if unseen:
        logger.warning("selection: %d of %d rows have no rollouts and were dropped", unseen, len(rows))
    logger.info("selection: kept %d of %d rows with pass count in [%d, %d]", len(kept), len(rows), lo, hi)
    return kept


def select_by_level(
    rows: list[dict], pass_counts: dict[str, Any], n_rollouts: int, levels: Iterable[str] = ("medium",)
) -> list[dict]:
    """Rows whose `difficulty_level` is in `levels` (R1-Searcher stage 1: medium; stage 2: medium + hard)."""
    levels = set(levels)
    if levels - set(LEVELS):
        raise ValueError(f"levels: {sorted(levels - set(LEVELS))} not in {LEVELS}")
    scored = select_by_pass_counts(rows, pass_counts, n_rollouts, (0, n_rollouts))
    return [r for r in scored if difficulty_level(r["pass_count"], n_rollouts) in levels]


def _field(row: dict, name: str) -> Any:
    if name in row:
        return row[name]
    extra = row.get("extra_info") or {}
    if name in extra:
        return extra[name]
    raise KeyError(f"curriculum key {name!r}: not in the row or its extra_info (keys {sorted(row)})")


# Built-in curriculum keys: smaller = earlier (easier).
CURRICULUM_KEYS: dict[str, Callable[[dict], Any]] = {
    "hops": lambda r: _field(r, "hops"),
    "pass_rate": lambda r: -_field(r, "pass_rate"),  # most often solved first
    "dag_nodes": lambda r: _field(r, "dag_nodes"),  # R-Search DAG: fewer sources / nodes first
    "question_length": lambda r: len(str(_field(r, "question")).split()),
}


def curriculum_order(rows: list[dict], key: str | Callable[[dict], Any], reverse: bool = False) -> list[dict]:
    """Rows sorted easy -> hard by `key` (a name in CURRICULUM_KEYS, any row / extra_info field, or a function);
    stable, so ties keep their input order. Train with `data.shuffle=false` to keep the order."""
    if callable(key):
        fn = key
    elif key in CURRICULUM_KEYS:
        fn = CURRICULUM_KEYS[key]
    else:
        fn = lambda r: _field(r, key)  # noqa: E731
    return sorted(rows, key=fn, reverse=reverse)


def main(argv: list[str] | None = None) -> None:
    # CLI only: pandas and prepare (the rollout protocols) stay out of the selection helpers' import
    import pandas as pd

    from rsearch_verl.data.parquet_data import write_parquet

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", required=True, help="parquet files made by rsearch_verl.data.prepare")
    parser.add_argument("--dumps", nargs="+", required=True, help="rollout dump directories or JSONL files")
    parser.add_argument("--n-rollouts", type=int, required=True)
    parser.add_argument("--pass-threshold", type=float, default=1.0)
    band = parser.add_mutually_exclusive_group(required=True)
    band.add_argument("--keep", nargs=2, type=int, metavar=("LO", "HI"), help="pass-count band, inclusive")
    band.add_argument("--levels", help="comma-separated: " + ",".join(LEVELS))
    parser.add_argument("--order", default=None, help="curriculum key: " + ", ".join(CURRICULUM_KEYS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rows = pd.concat([pd.read_parquet(f) for f in args.rows], ignore_index=True).to_dict("records")
    counts = count_passes(args.dumps, args.pass_threshold)
    if args.keep:
        kept = select_by_pass_counts(rows, counts, args.n_rollouts, tuple(args.keep))
    else:
        kept = select_by_level(rows, counts, args.n_rollouts, args.levels.split(","))
    if args.order:
        kept = curriculum_order(kept, args.order)
    if not kept:
        raise SystemExit("selection: no rows left; widen --keep / --levels")
    write_parquet(kept, args.out)
    print(f"kept {len(kept)} of {len(rows)} rows -> {args.out}")  # noqa: T201


if __name__ == "__main__":
    main()
