"""FlashRAG-format QA files -> training / evaluation parquet with a protocol's prompt (verl / Search-R1 layout).

Input layout (as FlashRAG publishes it): `DIR/<dataset>/<split>.jsonl`, one question per line,
`{"id", "question", "golden_answers": [str, ...], ...}`. Dataset folders: nq, triviaqa, popqa, hotpotqa,
2wikimultihopqa (alias `2wiki`), musique, bamboogle. FlashRAG's splits are train / dev / test (popqa and
bamboogle only have test). Explicit files can be given instead of a directory (`--input a.jsonl b.jsonl`);
their dataset name is then taken from `--datasets` (one per file) or from the parent folder's name.

Each output row: `id` ("<dataset>-<original id>"), `question` (stripped, with a final '?' added as Search-R1 does),
`prompt` (the protocol's prompt: a string for `--variant base`, chat messages for `--variant instruct`),
`data_source` (the dataset name), `ability` ("fact-reasoning"), `reward_model` ({"style": "rule",
"ground_truth": {"target": [...]}}), `extra_info` ({"index", "split", "question", "orig_id", "hops"}; hops is 1
for single-hop datasets, 2 for multi-hop ones, MuSiQue's own count from its id "3hop1__..."), read by
`rsearch_verl.data.dataset.PromptDataset.from_parquet`.

Usage:
    python -m rsearch_verl.data.prepare --input data/flashrag --datasets nq,hotpotqa --split train \
        --protocol search_r1 --variant base --out data/search_r1          # -> data/search_r1/train.parquet
    python -m rsearch_verl.data.prepare --input data/flashrag --datasets nq,triviaqa,popqa,hotpotqa,2wiki,musique,\
bamboogle --split test --protocol search_r1 --out data/search_r1 --per-dataset   # also <dataset>_test.parquet
    python -m rsearch_verl.data.prepare --format browsecomp_plus --input data/browsecomp_plus --split test \
        --protocol search_r1 --out data/bcp     # queries + corpus + qrels (rsearch_verl/data/browsecomp_plus.py)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random

from rsearch_verl.choices import PROMPT_VARIANTS
from rsearch_verl.data.parquet_data import write_parquet
from rsearch_verl.rollout.protocols import get_protocol

logger = logging.getLogger(__name__)

# dataset name -> (FlashRAG folder name, default number of hops)
DATASETS = {
    "nq": ("nq", 1),
    "triviaqa": ("triviaqa", 1),
    "popqa": ("popqa", 1),
    "hotpotqa": ("hotpotqa", 2),
    "2wiki": ("2wikimultihopqa", 2),
    "musique": ("musique", 2),
    "bamboogle": ("bamboogle", 2),
}
ALIASES = {"2wikimultihopqa": "2wiki"}


def canonical_dataset(name: str) -> str:
    name = ALIASES.get(name.lower(), name.lower())
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r} (known: {sorted(DATASETS)})")
    return name


def dataset_file(input_dir: str, dataset: str, split: str) -> str:
    """`DIR/<folder>/<split>.jsonl`, accepting both our name and FlashRAG's folder name (2wiki / 2wikimultihopqa)."""
    dataset = canonical_dataset(dataset)
    for folder in dict.fromkeys([DATASETS[dataset][0], dataset]):
        path = os.path.join(input_dir, folder, f"{split}.jsonl")
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{dataset}: no {split}.jsonl under {os.path.join(input_dir, DATASETS[dataset][0])}")


def read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from e
            missing = [k for k in ("question", "golden_answers") if k not in row]
            if missing:
                raise ValueError(f"{path}:{n}: missing {missing} (FlashRAG rows need id, question, golden_answers)")
            rows.append(row)
    return rows


def normalize_question(question: str) -> str:
    q = question.strip()
    return q if q.endswith("?") else q + "?"


def _hops(dataset: str, orig_id: str) -> int:
    if dataset == "musique" and "hop" in orig_id[:2]:
        return int(orig_id[0])  # MuSiQue ids start with "2hop__", "3hop1__", "4hop3__"
    return DATASETS[dataset][1]


def to_rows(records: list[dict], dataset: str, split: str, protocol, variant: str) -> list[dict]:
    """FlashRAG records of one dataset -> output rows (see the module docstring)."""
    dataset = canonical_dataset(dataset)
    out = []
    for index, rec in enumerate(records):
        question = normalize_question(str(rec["question"]))
        answers = rec["golden_answers"]
        answers = [str(a) for a in (answers if isinstance(answers, list) else [answers])]
        if not question.strip("?") or not answers:
            raise ValueError(f"{dataset}/{split} row {index}: empty question or golden_answers")
        orig_id = str(rec.get("id", index))
        out.append(
            {
                "id": f"{dataset}-{orig_id}",
                "question": question,
                "prompt": protocol.build_prompt(question, variant),
                "data_source": dataset,
                "ability": "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
                "extra_info": {
                    "index": index,
                    "split": split,
                    "question": question,
                    "orig_id": orig_id,
                    "hops": _hops(dataset, orig_id),
                },
            }
        )
    return out


def prepare(
    inputs: list[str],
    datasets: list[str],
    split: str,
    protocol_name: str,
    variant: str,
    out_dir: str,
    *,
    per_dataset: bool = False,
    max_per_dataset: int | None = None,
    seed: int = 0,
) -> dict[str, str]:
    """Convert and write; returns {name: parquet path} ("all" = `<out>/<split>.parquet`, plus each dataset's
    `<out>/<dataset>_<split>.parquet` with `per_dataset`). `max_per_dataset` keeps a seeded random subset."""
    if variant not in PROMPT_VARIANTS:
        raise ValueError(f"--variant: {variant!r} is not one of {list(PROMPT_VARIANTS)}")
    protocol = get_protocol(protocol_name)  # the --protocol named, not a run's: prompts are rendered here, once
    sources = _resolve_inputs(inputs, datasets, split)
    written, everything = {}, []
    for dataset, path in sources:
        records = read_jsonl(path)
        if max_per_dataset is not None and len(records) > max_per_dataset:
            records = random.Random(seed).sample(records, max_per_dataset)
        rows = to_rows(records, dataset, split, protocol, variant)
        logger.info("%s: %d questions from %s", dataset, len(rows), path)
        everything += rows
        if per_dataset:
            written[dataset] = os.path.join(out_dir, f"{dataset}_{split}.parquet")
            write_parquet(rows, written[dataset])
    if not everything:
        raise ValueError("no questions found in the inputs")
    written["all"] = os.path.join(out_dir, f"{split}.parquet")
    write_parquet(everything, written["all"])
    return written


def _resolve_inputs(inputs: list[str], datasets: list[str], split: str) -> list[tuple[str, str]]:
    """[(dataset, jsonl path)] from one FlashRAG directory + dataset names, or from explicit files."""
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        if not datasets:
            raise ValueError("--datasets is required with a directory --input")
        return [(canonical_dataset(d), dataset_file(inputs[0], d, split)) for d in datasets]
    missing = [p for p in inputs if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"--input: not found: {missing}")
    if datasets and len(datasets) != len(inputs):
        raise ValueError(f"--datasets: give one name per input file ({len(inputs)} files, {len(datasets)} names)")
    names = datasets or [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in inputs]
    return [(canonical_dataset(d), p) for d, p in zip(names, inputs, strict=True)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="a FlashRAG directory, or jsonl files")
    parser.add_argument(
        "--format", default="flashrag", choices=("flashrag", "browsecomp_plus"),
        help="browsecomp_plus: --input is a directory of queries.jsonl, corpus.jsonl and qrels.tsv",
    )  # fmt: skip
    parser.add_argument("--datasets", default="", help="comma-separated, e.g. nq,hotpotqa")
    parser.add_argument("--split", default="train", help="train | dev | test")
    parser.add_argument("--protocol", default="search_r1")
    parser.add_argument("--variant", default="base", choices=PROMPT_VARIANTS)
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-dataset", action="store_true", help="also write <dataset>_<split>.parquet")
    parser.add_argument("--max-per-dataset", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    datasets = [d for d in args.datasets.split(",") if d]
    if args.format == "browsecomp_plus":
        from rsearch_verl.data.browsecomp_plus import prepare_browsecomp_plus

        if len(args.input) != 1:
            parser.error("--format browsecomp_plus takes one --input directory")
        written = prepare_browsecomp_plus(
            args.input[0], args.split, args.protocol, args.variant, args.out,
            max_queries=args.max_per_dataset, seed=args.seed,
        )  # fmt: skip
    else:
        written = prepare(
            args.input, datasets, args.split, args.protocol, args.variant, args.out,
            per_dataset=args.per_dataset, max_per_dataset=args.max_per_dataset, seed=args.seed,
        )  # fmt: skip
    for name, path in written.items():
        print(f"{name}\t{path}")  # noqa: T201


if __name__ == "__main__":
    main()
