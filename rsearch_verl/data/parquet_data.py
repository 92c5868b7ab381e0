"""The record of a run's data (`RunData`: the prompts it trains and validates on, the corpus its own retrieval server
serves) and the real-data loader, `data.source=parquet` (the rows written by rsearch_verl/data/prepare.py). The toy
world's loader is rsearch_verl/toy/run_data.py; rsearch_verl/run_data.py picks one by `data.source`.

    data = parquet_data(cfg, protocol)   # -> RunData(train_rows, val_rows, corpus, index_dir, tokenizer_path)
"""

from __future__ import annotations

import dataclasses

from rsearch_verl.config import RSearchConfig
from rsearch_verl.rollout.protocols import SearchProtocol


@dataclasses.dataclass
class RunData:
    train_rows: list[dict]
    val_rows: list[dict]
    corpus: str | None  # the corpus the recipe's own retriever serves (None: an external retriever)
    index_dir: str | None
    tokenizer_path: str | None = None  # the toy world's own small tokenizer


def parquet_data(cfg: RSearchConfig, proto: SearchProtocol) -> RunData:
    """`data.train_files` / `data.val_files` as rsearch_verl/data/prepare.py wrote them (prompts already rendered)."""
    # heavy: pandas only when parquet data is read
    import pandas as pd

    def read(files: list[str]) -> list[dict]:
        return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True).to_dict("records") if files else []

    return RunData(read(cfg.data.train_files), read(cfg.data.val_files), cfg.retriever.corpus, cfg.retriever.index_dir)
