"""The evaluation CLI end to end: FlashRAG-format fixtures (NQ, HotpotQA) -> `rsearch_verl.data.prepare` parquet
-> `python -m rsearch_verl.eval` with a tiny policy and the recipe's own BM25 retrieval server (a real uvicorn
process) -> the papers' table for both datasets and their average, per-example JSONL and results.json."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "data", "fixtures")
CORPUS = [
    ("d1", '"Paris"\nParis is the capital of France.'),
    ("d2", '"Barack Obama"\nBarack Obama was the 44th president of the United States.'),
    ("d3", '"Mount Everest"\nMount Everest is the highest mountain above sea level.'),
]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.slow
def test_eval_cli_table_for_two_datasets(tmp_path):
    data_dir = tmp_path / "data"
    for split, name in (("test", "nq"), ("dev", "hotpotqa")):
        cmd = [sys.executable, "-m", "rsearch_verl.data.prepare", "--input", FIXTURES, "--datasets", name]
        cmd += ["--split", split, "--protocol", "search_r1", "--out", str(data_dir / name), "--per-dataset"]
        subprocess.run(cmd, cwd=ROOT, env=_env(), check=True, capture_output=True, timeout=120)
    files = [str(data_dir / "nq" / "nq_test.parquet"), str(data_dir / "hotpotqa" / "hotpotqa_dev.parquet")]
    assert all(os.path.isfile(f) for f in files), os.listdir(data_dir / "nq")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "contents": c}) + "\n" for i, c in CORPUS))
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "rsearch_verl.eval", "--checkpoint", "tiny", "--data", *files, "--out", str(out)]
    cmd += ["--max-samples", "3", "+recipe=search_r1_ppo", "model.sft_checkpoint=null", f"retriever.corpus={corpus}"]
    cmd += [f"retriever.index_dir={tmp_path / 'index'}", "retriever.encoder=bm25", "rollout.max_turns=2"]
    cmd += ["rollout.max_tokens_per_turn=16", "rollout.max_response_length=96"]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    table_lines = [line.split() for line in done.stdout.splitlines()]
    names = [cols[0] for cols in table_lines if cols]
    assert {"nq_test", "hotpotqa_dev", "average"} <= set(names), done.stdout
    header = next(cols for cols in table_lines if cols and cols[0] == "dataset")
    assert header[1:] == ["n", "em", "f1", "cover_em", "searches", "reward"]
    # the protocol card under the table: every paper's setting, this run's differences flagged
    card = (out / "protocol_card.txt").read_text().strip()
    assert card in done.stdout and card.count("\n- ") == 5
    assert "this run: hotpotqa 3, nq 3" in card and "DIFFERS: hotpotqa: 3 examples, the paper 7405" in card
    results = json.loads((out / "results.json").read_text())
    assert results["nq_test"]["n"] == 3 and results["hotpotqa_dev"]["n"] == 3 and results["average"]["n"] == 6
    for name in ("nq_test", "hotpotqa_dev"):
        rows = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        assert len(rows) == 3
        assert {"question", "golden_answers", "answer", "response", "em", "f1", "cover_em", "searches"} <= set(rows[0])
        assert all(r["data_source"] == name.split("_")[0] for r in rows)
        mean_f1 = sum(r["f1"] for r in rows) / 3
        assert results[name]["f1"] == pytest.approx(mean_f1)


def test_missing_checkpoint_is_named_before_any_work(tmp_path, capsys):
    from rsearch_verl.eval.evaluate import build_parser, main

    with pytest.raises(SystemExit) as exc:
        main(["--checkpoint", "/nonexistent", "--toy-world", "--out", str(tmp_path / "out")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and "'/nonexistent' is not a directory" in last and "'tiny'" in last
    assert not (tmp_path / "out").exists()
    assert "--checkpoint tiny --toy-world" in build_parser().format_help()  # --help shows a working example
