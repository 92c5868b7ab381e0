"""BrowseComp-Plus-style fixture (queries JSONL, corpus JSONL, TREC qrels) written here -> `rsearch_verl.data.prepare
--format browsecomp_plus` -> parquet rows (ground truth, gold docids) + our corpus JSONL -> `python -m retrieval_server
build --chunk-tokens N` (BM25) indexes it and finds the gold document -> PromptDataset reads the rows."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from rsearch_verl.config import ModelConfig
from rsearch_verl.data.browsecomp_plus import corpus_record, read_qrels
from rsearch_verl.data.dataset import PromptDataset
from rsearch_verl.data.prepare import main
from rsearch_verl.models import load_tokenizer

QUERIES = [
    {"query_id": "q1", "query": "Which river flows through the city whose cathedral burned?", "answer": "Seine"},
    {"query_id": "q2", "query": "Name the volcano that buried Pompeii.", "answer": "Mount Vesuvius"},
    {"query_id": "q3", "query": "A question nobody annotated evidence for?", "answer": "unknown"},
]
CORPUS = [
    {"docid": "d1", "title": "Notre-Dame de Paris", "url": "https://example.org/notre-dame",
     "text": "The cathedral of Notre-Dame burned in April 2019. " * 3 + "Paris lies on the river Seine."},
    {"docid": "d2", "url": "https://example.org/pompeii",
     "text": "Pompeii was buried by the eruption of Mount Vesuvius in 79 AD. The volcano still stands near Naples."},
    {"docid": "d3", "text": "An unrelated page about sourdough bread and its starter."},
    {"docid": "d4", "title": "Seine", "text": "The Seine flows through Paris into the English Channel at Le Havre."},
]  # fmt: skip
QRELS = "q1 0 d1 1\nq1 0 d4 2\nq1 0 d3 0\n\nq2\t0\td2\t1\n"


def write_fixture(root) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUERIES))
    (root / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in CORPUS))
    (root / "qrels.tsv").write_text(QRELS)


def test_prepare_browsecomp_plus_and_index_it(tmp_path, capsys):
    src, out = tmp_path / "bcp", tmp_path / "out"
    write_fixture(src)
    main(["--format", "browsecomp_plus", "--input", str(src), "--split", "test", "--protocol", "search_r1",
          "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert f"all\t{out / 'test.parquet'}" in printed and f"corpus\t{out / 'corpus.jsonl'}" in printed

    df = pd.read_parquet(out / "test.parquet")
    assert list(df["id"]) == ["browsecomp_plus-q1", "browsecomp_plus-q2", "browsecomp_plus-q3"]
    assert set(df["data_source"]) == {"browsecomp_plus"}
    targets = [list(t["ground_truth"]["target"]) for t in df["reward_model"]]
    assert targets == [["Seine"], ["Mount Vesuvius"], ["unknown"]]
    extra = list(df["extra_info"])
    assert [list(e["gold_docids"]) for e in extra] == [["d1", "d4"], ["d2"], []]  # relevance 0 is not gold
    assert extra[0]["orig_id"] == "q1" and extra[0]["question"] == QUERIES[0]["query"]
    assert QUERIES[1]["query"] in df["prompt"][1]  # the protocol's prompt around the query

    docs = [json.loads(line) for line in (out / "corpus.jsonl").read_text().splitlines()]
    assert [set(d) for d in docs] == [{"id", "contents"}] * 4
    assert docs[0]["contents"].startswith('"Notre-Dame de Paris"\nThe cathedral')
    assert docs[1]["contents"].startswith('"https://example.org/pompeii"\n')  # no title: the url
    assert docs[2]["contents"].startswith('"d3"\n')  # neither: the docid

    # the corpus is what `python -m retrieval_server build --chunk-tokens N` indexes: long documents become passages
    from retrieval_server.__main__ import main as retrieval_main
    from retrieval_server.retriever import load_retriever

    index = tmp_path / "index"
    cmd = ["build", "--corpus", str(out / "corpus.jsonl"), "--encoder", "bm25", "--out", str(index)]
    assert retrieval_main([*cmd, "--chunk-tokens", "12"]) in (0, None)
    retriever = load_retriever(str(index))
    manifest = json.loads((index / "manifest.json").read_text())
    assert manifest["chunk_tokens"] == 12 and manifest["n_docs"] > len(CORPUS)
    rows, _ = retriever.search(["volcano buried Pompeii"], 1)
    top = retriever.docs(rows[0])[0]
    assert top["doc_id"] == "d2" and top["doc_id"] in extra[1]["gold_docids"]

    tokenizer = load_tokenizer(ModelConfig())
    dataset = PromptDataset.from_parquet([str(out / "test.parquet")], tokenizer, 512)
    assert len(dataset) == 3


def test_bad_inputs_are_named(tmp_path):
    src = tmp_path / "bcp"
    write_fixture(src)
    (src / "qrels.tsv").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks \['qrels.tsv or qrels.txt'\]"):
        main(["--format", "browsecomp_plus", "--input", str(src), "--out", str(tmp_path / "o")])
    (src / "qrels.txt").write_text("q1 0 d1\n")
    with pytest.raises(ValueError, match=r"qrels.txt:1: a qrels line is 'query_id 0 docid relevance'"):
        read_qrels(str(src / "qrels.txt"))
    (src / "qrels.txt").write_text("q1 0 d1 1\n")
    (src / "queries.jsonl").write_text('{"query_id": "q1", "query": "x?"}\n')
    with pytest.raises(ValueError, match=r"queries.jsonl:1: missing \['answer'\]"):
        main(["--format", "browsecomp_plus", "--input", str(src), "--out", str(tmp_path / "o")])
    doc = corpus_record({"docid": 7, "title": "Two\nlines", "text": " body "})
    assert doc == {"id": "7", "contents": '"Two lines"\nbody'}
