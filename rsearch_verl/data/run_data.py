"""The prompts a run trains and validates on, and the corpus its own retrieval server serves.

`data.source=toy_world` builds (or reuses) the embedded toy world (rsearch_verl/toy/world.py), renders its
questions with the recipe's protocol and, for the tiny policy, trains the world's tokenizer
(rsearch_verl/toy/tokenizer.py); `data.source=parquet` reads the rows written by rsearch_verl/data/prepare.py.

Usage:
    data = load_run_data(cfg, protocol)   # -> RunData(train_rows, val_rows, corpus, index_dir, tokenizer_path)
                                          # `protocol`: the run's (protocol_for(cfg)), which renders the prompts
"""

from __future__ import annotations

import dataclasses
import json
import os

from rsearch_verl.config import DATA_SOURCES, RSearchConfig
from rsearch_verl.rollout.protocols import SearchProtocol
from rsearch_verl.toy.tokenizer import toy_tokenizer
from rsearch_verl.toy.world import build_toy_world


@dataclasses.dataclass
class RunData:
    train_rows: list[dict]
    val_rows: list[dict]
    corpus: str | None  # the corpus the recipe's own retriever serves (None: an external retriever)
    index_dir: str | None
    tokenizer_path: str | None = None  # the toy world's own small tokenizer


def toy_world_data(cfg: RSearchConfig, proto: SearchProtocol) -> RunData:
    """Build or reuse the toy world; prompts rendered with the run's protocol `proto`."""
    world = build_toy_world(cfg.data.toy_world)
    tok_dir = toy_tokenizer(world, [cfg.rollout.protocol]) if cfg.model.path == "tiny" else None

    def rows(path: str) -> list[dict]:
        out = []
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                out.append(
                    {
                        "id": rec["id"],
                        "prompt": proto.build_prompt(rec["question"], cfg.prompt_variant),
                        "question": rec["question"],
                        "golden_answers": rec["golden_answers"],
                        "data_source": rec.get("data_source", "toy_world"),
                        "extra_info": {"hops": rec.get("hops"), "support": rec.get("support", [])},
                    }
                )
        return out

    index_dir = cfg.retriever.index_dir or os.path.join(
        os.path.dirname(world.corpus_path), f"index_{cfg.retriever.encoder}_{cfg.retriever.index_type}"
    )
    return RunData(rows(world.train_path), rows(world.val_path), world.corpus_path, index_dir, tok_dir)


def parquet_data(cfg: RSearchConfig, proto: SearchProtocol) -> RunData:
    """`data.train_files` / `data.val_files` as rsearch_verl/data/prepare.py wrote them (prompts already rendered)."""
    import pandas as pd

    def read(files: list[str]) -> list[dict]:
        return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True).to_dict("records") if files else []

    return RunData(read(cfg.data.train_files), read(cfg.data.val_files), cfg.retriever.corpus, cfg.retriever.index_dir)


LOADERS = {"toy_world": toy_world_data, "parquet": parquet_data}  # one per DATA_SOURCES name (the config's list)
assert set(LOADERS) == set(DATA_SOURCES), "a data source without its loader (or the reverse)"


def load_run_data(cfg: RSearchConfig, protocol: SearchProtocol) -> RunData:
    """The run's data (`data.source`). `protocol`: the run's (`protocol_for(cfg)`), which renders the prompts."""
    if cfg.data.source not in LOADERS:
        raise ValueError(f"data.source: {cfg.data.source!r} is not one of {list(DATA_SOURCES)}")
    return LOADERS[cfg.data.source](cfg, protocol)
