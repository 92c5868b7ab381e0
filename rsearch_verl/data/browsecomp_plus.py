"""BrowseComp-Plus-style sets (queries, a fixed document corpus, qrels) -> our parquet rows and corpus JSONL.

Input: one directory holding
* `queries.jsonl`: `{"query_id", "query", "answer"}` per line (the answer is the ground truth, one string);
* `corpus.jsonl`: `{"docid", "text", "url"?, "title"?}` per line (whole web documents, often long);
* `qrels.tsv` (or `qrels.txt`): TREC qrels, `query_id  0  docid  relevance` per line, whitespace-separated; a
  relevance > 0 makes the document a gold (evidence) document of that query.

Output (what `rsearch_verl.data.prepare` writes for FlashRAG sets, plus the evidence):
* `<out>/<split>.parquet`: one row per query, `id` "browsecomp_plus-<query_id>", `data_source` "browsecomp_plus",
  `reward_model.ground_truth.target` [answer], `extra_info` {"index", "split", "question", "orig_id", "hops",
  "gold_docids": [docid, ...]} (qrels order; a query without qrels has none);
* `<out>/corpus.jsonl`: our corpus contract `{"id": docid, "contents": "\"Title\"\ntext"}` (title: the document's
  title, else its url, else its docid), ready for `python -m retrieval_server build --corpus <out>/corpus.jsonl
  --encoder bm25 --out indexes/bcp --chunk-tokens 512` (documents are long: index passages, open whole documents).

    python -m rsearch_verl.data.prepare --format browsecomp_plus --input data/browsecomp_plus --split test \
        --protocol search_r1 --out data/bcp
"""

from __future__ import annotations

import json
import logging
import os
import random

from rsearch_verl.data.parquet_data import write_parquet
from rsearch_verl.rollout.protocols import get_protocol

logger = logging.getLogger(__name__)

DATA_SOURCE = "browsecomp_plus"
QRELS_NAMES = ("qrels.tsv", "qrels.txt")


def _jsonl(path: str, required: tuple[str, ...]):
    """(line number, record) for each non-empty line; a bad line or a missing key is an error naming the line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from e
            missing = [k for k in required if k not in rec]
            if missing:
                raise ValueError(f"{path}:{n}: missing {missing} (need {list(required)})")
            yield n, rec


def read_queries(path: str) -> list[dict]:
    return [rec for _, rec in _jsonl(path, ("query_id", "query", "answer"))]


def read_qrels(path: str) -> dict[str, list[str]]:
    """TREC qrels -> {query_id: [gold docid, ...]} (relevance > 0 only, in file order)."""
    gold: dict[str, list[str]] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            cols = line.split()
            if not cols:
                continue
            if len(cols) != 4:
                raise ValueError(f"{path}:{n}: a qrels line is 'query_id 0 docid relevance', got {line.strip()!r}")
            qid, _, docid, rel = cols
            try:
                relevant = float(rel) > 0
            except ValueError as e:
                raise ValueError(f"{path}:{n}: relevance {rel!r} is not a number") from e
            if relevant:
                gold.setdefault(qid, []).append(docid)
    return gold


def corpus_record(rec: dict) -> dict:
    """One corpus document in our contract: `{"id", "contents": "\"Title\"\ntext"}`."""
    docid = str(rec["docid"])
    title = str(rec.get("title") or rec.get("url") or docid).strip().replace("\n", " ")
    return {"id": docid, "contents": f'"{title}"\n{str(rec["text"]).strip()}'}


def convert_corpus(src: str, dst: str) -> set[str]:
    """Stream `src` into our corpus JSONL at `dst` (atomic); return the docids written. Duplicate docids: an error."""
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    tmp = f"{dst}.tmp-{os.getpid()}"
    seen: set[str] = set()
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for n, rec in _jsonl(src, ("docid", "text")):
                doc = corpus_record(rec)
                if doc["id"] in seen:
                    raise ValueError(f"{src}:{n}: docid {doc['id']!r} appears twice")
                seen.add(doc["id"])
                out.write(json.dumps(doc, ensure_ascii=False) + "\n")
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return seen


def to_rows(queries: list[dict], gold: dict[str, list[str]], split: str, protocol, variant: str) -> list[dict]:
    """Query records -> parquet rows in `rsearch_verl.data.prepare`'s layout, the gold docids in extra_info."""
    rows = []
    for index, rec in enumerate(queries):
        qid, question, answer = str(rec["query_id"]), str(rec["query"]).strip(), str(rec["answer"]).strip()
        if not question or not answer:
            raise ValueError(f"{DATA_SOURCE} query {qid!r}: empty query or answer")
        rows.append(
            {
                "id": f"{DATA_SOURCE}-{qid}",
                "question": question,
                "prompt": protocol.build_prompt(question, variant),
                "data_source": DATA_SOURCE,
                "ability": "deep-research",
                "reward_model": {"style": "rule", "ground_truth": {"target": [answer]}},
                "extra_info": {
                    "index": index,
                    "split": split,
                    "question": question,
                    "orig_id": qid,
                    "hops": max(1, len(gold.get(qid, []))),
                    "gold_docids": list(gold.get(qid, [])),
                },
            }
        )
    return rows


def input_files(input_dir: str) -> tuple[str, str, str]:
    """(queries, corpus, qrels) paths under `input_dir`; a missing one is an error naming what is expected."""
    queries, corpus = os.path.join(input_dir, "queries.jsonl"), os.path.join(input_dir, "corpus.jsonl")
    qrels = next((os.path.join(input_dir, q) for q in QRELS_NAMES if os.path.isfile(os.path.join(input_dir, q))), "")
    missing = [name for name, p in (("queries.jsonl", queries), ("corpus.jsonl", corpus)) if not os.path.isfile(p)]
    if not qrels:
        missing.append(" or ".join(QRELS_NAMES))
    if missing:
        raise FileNotFoundError(f"--format browsecomp_plus: {input_dir} lacks {missing}")
    return queries, corpus, qrels


def prepare_browsecomp_plus(
    input_dir: str,
    split: str,
    protocol_name: str,
    variant: str,
    out_dir: str,
    *,
    max_queries: int | None = None,
    seed: int = 0,
) -> dict[str, str]:
    """Convert and write; returns {"all": parquet path, "corpus": corpus JSONL path}. `max_queries` keeps a seeded
    random subset of the queries (the corpus is always whole: it is the fixed search space)."""
    queries_path, corpus_path, qrels_path = input_files(input_dir)
    queries, gold = read_queries(queries_path), read_qrels(qrels_path)
    if not queries:
        raise ValueError(f"{queries_path}: no queries")
    if max_queries is not None and len(queries) > max_queries:
        queries = random.Random(seed).sample(queries, max_queries)
    written = {"corpus": os.path.join(out_dir, "corpus.jsonl"), "all": os.path.join(out_dir, f"{split}.parquet")}
    docids = convert_corpus(corpus_path, written["corpus"])
    unknown = sorted({d for q in queries for d in gold.get(str(q["query_id"]), []) if d not in docids})
    if unknown:
        logger.warning("qrels name %d docids the corpus lacks (e.g. %s)", len(unknown), unknown[:3])
    rows = to_rows(queries, gold, split, get_protocol(protocol_name), variant)
    write_parquet(rows, written["all"])
    logger.info("%s: %d queries, %d documents -> %s", DATA_SOURCE, len(rows), len(docids), out_dir)
    return written
