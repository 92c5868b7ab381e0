"""The run's data, by `data.source`: the toy world (rsearch_verl/toy/world_data.py) or parquet files
(rsearch_verl/data/parquet_data.py), each returning the record rsearch_verl/run_data.py. Sits above both wings, which
import neither each other's loader nor this.

    data = load_run_data(cfg, protocol)   # -> RunData(train_rows, val_rows, corpus, index_dir, tokenizer_path)
                                          # `protocol`: the run's (protocol_for(cfg)), which renders the prompts
"""

from __future__ import annotations

from rsearch_verl.config import DATA_SOURCES, RSearchConfig
from rsearch_verl.data.parquet_data import parquet_data
from rsearch_verl.rollout.protocols import SearchProtocol
from rsearch_verl.run_data import RunData
from rsearch_verl.toy.world_data import toy_world_data

LOADERS = {"toy_world": toy_world_data, "parquet": parquet_data}  # one per DATA_SOURCES name (the config's list)
assert set(LOADERS) == set(DATA_SOURCES), "a data source without its loader (or the reverse)"


def load_run_data(cfg: RSearchConfig, protocol: SearchProtocol) -> RunData:
    """The run's data (`data.source`). `protocol`: the run's (`protocol_for(cfg)`), which renders the prompts."""
    if cfg.data.source not in LOADERS:
        raise ValueError(f"data.source: {cfg.data.source!r} is not one of {list(DATA_SOURCES)}")
    return LOADERS[cfg.data.source](cfg, protocol)
