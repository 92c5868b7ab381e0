"""FlashRAG-format fixtures -> parquet with the protocol's prompt -> PromptDataset, via the CLI and the API."""

from __future__ import annotations

import os
import shutil

import pandas as pd
import pytest

from rsearch_verl.config import ModelConfig
from rsearch_verl.data.dataset import PromptDataset
from rsearch_verl.data.prepare import main, normalize_question, prepare
from rsearch_verl.models import load_tokenizer
from rsearch_verl.rollout.protocols import get_protocol

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig())


def test_cli_base_prompts_to_prompt_dataset(tmp_path, tokenizer, capsys):
    main(["--input", FIXTURES, "--datasets", "nq,hotpotqa", "--split", "train", "--protocol", "search_r1",
          "--variant", "base", "--out", str(tmp_path), "--per-dataset"])  # fmt: skip
    assert "train.parquet" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["hotpotqa_train.parquet", "nq_train.parquet", "train.parquet"]
    df = pd.read_parquet(tmp_path / "train.parquet")
    assert len(df) == 8 + 7 and list(df["data_source"].unique()) == ["nq", "hotpotqa"]
    row = df.iloc[0]
    assert row["id"] == "nq-train_0" and row["question"] == "total number of death row inmates in the us?"
    assert row["prompt"] == get_protocol("search_r1").build_prompt(row["question"], "base")
    assert row["reward_model"]["style"] == "rule" and list(row["reward_model"]["ground_truth"]["target"]) == ["2,718"]
    assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == 0
    assert row["extra_info"]["question"] == row["question"] and row["extra_info"]["hops"] == 1
    assert df.iloc[-1]["extra_info"]["hops"] == 2  # hotpotqa is multi-hop
    eiffel = df[df["id"] == "nq-train_7"].iloc[0]
    assert list(eiffel["reward_model"]["ground_truth"]["target"]) == ["1889", "31 March 1889"]

    ds = PromptDataset.from_parquet([str(tmp_path / "train.parquet")], tokenizer, max_prompt_length=4096)
    assert len(ds) == 15
    first = ds.rows[0]
    assert first.id == "nq-train_0" and first.ground_truth == ["2,718"] and first.data_source == "nq"
    assert first.prompt_text == row["prompt"] and first.question == row["question"]
    assert tokenizer.decode(first.prompt_ids) == first.prompt_text
    assert ds.rows[14].ground_truth == ["no"] and ds.rows[14].extra["hops"] == 2


def test_instruct_variant_is_chat_messages(tmp_path, tokenizer):
    written = prepare([FIXTURES], ["hotpotqa"], "dev", "research", "instruct", str(tmp_path))
    df = pd.read_parquet(written["all"])
    messages = [dict(m) for m in df.iloc[0]["prompt"]]
    assert messages == get_protocol("research").build_prompt(df.iloc[0]["question"], "instruct")
    assert messages[-1]["role"] == "user" and df.iloc[0]["question"] in messages[-1]["content"]
    ds = PromptDataset.from_parquet([written["all"]], tokenizer, max_prompt_length=4096)
    assert ds.rows[0].prompt_text.startswith("<|im_start|>") and ds.rows[0].prompt_text.endswith("assistant\n")
    assert ds.rows[1].ground_truth == ["Chief of Protocol"]


def test_explicit_files_aliases_and_subsets(tmp_path):
    wiki = tmp_path / "in" / "2wikimultihopqa"
    wiki.mkdir(parents=True)
    shutil.copy(os.path.join(FIXTURES, "hotpotqa", "dev.jsonl"), wiki / "dev.jsonl")
    # the 2wiki alias finds FlashRAG's 2wikimultihopqa folder
    df = pd.read_parquet(
        prepare([str(tmp_path / "in")], ["2wiki"], "dev", "search_r1", "base", str(tmp_path / "a"))["all"]
    )
    assert set(df["data_source"]) == {"2wiki"}
    # explicit files take their dataset name from the parent folder, or from --datasets
    files = [os.path.join(FIXTURES, "nq", "test.jsonl"), str(wiki / "dev.jsonl")]
    out = prepare(files, [], "test", "search_r1", "base", str(tmp_path / "b"), max_per_dataset=3, seed=1)
    df = pd.read_parquet(out["all"])
    assert list(df["data_source"]) == ["nq"] * 3 + ["2wiki"] * 3
    again = pd.read_parquet(
        prepare(files, [], "test", "search_r1", "base", str(tmp_path / "c"), max_per_dataset=3, seed=1)["all"]
    )
    assert list(again["id"]) == list(df["id"])  # the subset is seeded


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset"):
        prepare([FIXTURES], ["squad"], "train", "search_r1", "base", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="popqa"):
        prepare([FIXTURES], ["popqa"], "test", "search_r1", "base", str(tmp_path))
    with pytest.raises(ValueError, match="variant"):
        prepare([FIXTURES], ["nq"], "train", "search_r1", "chat", str(tmp_path))
    with pytest.raises(ValueError, match="unknown search protocol"):
        prepare([FIXTURES], ["nq"], "train", "nope", "base", str(tmp_path))
    bad = tmp_path / "nq" / "train.jsonl"
    bad.parent.mkdir()
    bad.write_text('{"id": "1", "question": "q?"}\n')
    with pytest.raises(ValueError, match="golden_answers"):
        prepare([str(tmp_path)], ["nq"], "train", "search_r1", "base", str(tmp_path / "o"))
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        prepare([str(tmp_path)], ["nq"], "train", "search_r1", "base", str(tmp_path / "o"))
    assert normalize_question("  who won  ") == "who won?" and normalize_question("why?") == "why?"
