"""The record of a run's data: the prompts it trains and validates on and the corpus its own retrieval server serves.
Every data source's loader returns one (rsearch_verl/trainer/data_sources.py picks the loader by `data.source`).

    data = RunData(train_rows, val_rows, corpus, index_dir, tokenizer_path)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RunData:
    train_rows: list[dict]
    val_rows: list[dict]
    corpus: str | None  # the corpus the recipe's own retriever serves (None: an external retriever)
    index_dir: str | None
    tokenizer_path: str | None = None  # the toy world's own small tokenizer
