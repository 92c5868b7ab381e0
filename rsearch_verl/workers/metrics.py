"""Reduction of the metrics worker groups return: every worker of a group reports its own value per key, and
`DataProto.concat` collects them into lists; the driver logs one float per key.

    metrics = reduce_metrics(out.meta_info)     # {"actor/pg_loss": 0.12, ...}
"""

from __future__ import annotations

import numpy as np


def reduce_metrics(meta_info: dict) -> dict:
    """Average the per-worker metric lists that DataProto.concat collects into one float per key."""
    metrics = meta_info.get("metrics") or {}
    return {k: float(np.mean(v)) if isinstance(v, list) else float(v) for k, v in metrics.items()}
