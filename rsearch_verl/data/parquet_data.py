"""Real data as a run's data (`data.source=parquet`): the rows rsearch_verl/data/prepare.py wrote, prompts already
rendered.

    data = parquet_data(cfg, protocol)   # -> rsearch_verl.run_data.RunData
    write_parquet(rows, "data/nq/train.parquet")   # how prepare.py and selection.py write them (atomically)
"""

from __future__ import annotations

import os

from rsearch_verl.config import RSearchConfig
from rsearch_verl.rollout.protocols import SearchProtocol
from rsearch_verl.run_data import RunData


def parquet_data(cfg: RSearchConfig, proto: SearchProtocol) -> RunData:
    """`data.train_files` / `data.val_files` as rsearch_verl/data/prepare.py wrote them (prompts already rendered)."""
    # heavy: pandas only when parquet data is read
    import pandas as pd

    def read(files: list[str]) -> list[dict]:
        return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True).to_dict("records") if files else []

    return RunData(read(cfg.data.train_files), read(cfg.data.val_files), cfg.retriever.corpus, cfg.retriever.index_dir)


def write_parquet(rows: list[dict], path: str) -> None:
    """Atomic write (temp file + rename) so a reader never sees half a file."""
    # heavy: pandas only when a parquet file is written
    import pandas as pd

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    pd.DataFrame(rows).to_parquet(tmp, index=False)
    os.replace(tmp, path)
