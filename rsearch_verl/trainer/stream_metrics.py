"""A streaming step's metrics (trainer.rollout_mode=streaming, docs/async_training.md): lags, throughput, queue
depth, what was dropped or lost, and the rollout workers' search windows. Collecting them never polls a worker (a
poll hands finished groups over; `StreamWorkers.window` reads the windows only).

  stream/lag_head_max, stream/lag_head_mean   updates between the weights trained and an admitted group's oldest token
  stream/lag_tail_max                         the same for its newest token
  stream/multi_version_rows_frac              rows whose policy tokens come from more than one policy version
  stream/staleness_max, stream/staleness_<j>_frac   the head lag as the oldest_token rule bounds it (j = 0..k)
  stream/trajectories_per_s, stream/wait_s, stream/queue_depth, stream/groups_in_flight, stream/turn_bias, ...
  stream/dropped_stale, stream/aborted, stream/lost_trajectories, stream/rollout_workers_lost   (counted)

    metrics = StreamMetrics(max_staleness=k)
    metrics.finished(turns)                              # every group that finishes (for the turn bias)
    out = metrics.step(step, admitted, batch, wait_s, windows, feed_state)
"""

from __future__ import annotations

import collections
import time

import numpy as np
import torch
from verl import DataProto

from rsearch_verl import signals as sig
from rsearch_verl.trainer.admission import Candidate, staleness
from rsearch_verl.workers.metrics import reduce_metrics


class StreamMetrics:
    def __init__(self, max_staleness: int):
        self.k = max_staleness
        self._admitted_turns, self._finished_turns = [0, 0], [0, 0]  # (sum, count), for the bias
        self._rate_since, self._done_before = time.perf_counter(), {}  # trajectories per second: per worker

    def finished(self, turns: tuple[int, ...]) -> None:
        self._finished_turns[0] += sum(turns)
        self._finished_turns[1] += len(turns)

    def step(self, step: int, admitted: list[Candidate], batch: DataProto, wait_s: float, windows: dict[int, dict],
             queue: dict[str, float]) -> dict[str, float]:  # fmt: skip
        """The step's metrics: `windows` from `StreamWorkers.window`, `queue` the pipeline's own counts."""
        per_worker = collections.defaultdict(list)
        for window in windows.values():
            for key, value in window.get("metrics", {}).items():
                per_worker[key].append(value)
        metrics = reduce_metrics({"metrics": dict(per_worker)})  # the mean over workers, as a batch's chunks
        turns = [t for c in admitted for t in c.turns]
        self._admitted_turns[0] += sum(turns)
        self._admitted_turns[1] += len(turns)
        metrics.update({
            **queue,
            "stream/trajectories_in_flight": float(sum(w.get("trajectories_in_flight", 0) for w in windows.values())),
            "stream/wait_s": wait_s,
            "stream/trajectories_per_s": self._rate(windows),
            "stream/admitted_turns_mean": float(np.mean(turns)) if turns else 0.0,
            "stream/turn_bias": _ratio(self._admitted_turns, self._finished_turns),
            "stream/multi_version_rows_frac": multi_version_rows(batch),
            **lag_metrics(step, admitted, self.k),
        })  # fmt: skip
        return metrics

    def _rate(self, windows: dict[int, dict]) -> float:
        """Trajectories the rollout workers finished per second since the last step's admission."""
        now = time.perf_counter()
        done = {i: w.get("trajectories_done", 0) for i, w in windows.items()}
        rate = sum(n - self._done_before.get(i, 0) for i, n in done.items()) / max(1e-9, now - self._rate_since)
        self._done_before, self._rate_since = done, now
        return rate


def lag_metrics(step: int, admitted: list[Candidate], max_staleness: int) -> dict[str, float]:
    """Head and tail lags of the admitted groups (module docstring)."""
    head = [staleness(step, c.oldest_version) for c in admitted]
    tail = [staleness(step, c.newest) for c in admitted]
    out = {
        "stream/lag_head_max": float(max(head, default=0)),
        "stream/lag_head_mean": float(np.mean(head)) if head else 0.0,
        "stream/lag_tail_max": float(max(tail, default=0)),
        "stream/staleness_max": float(max(head, default=0)),
    }
    for j in range(max_staleness + 1):
        out[f"stream/staleness_{j}_frac"] = float(np.mean([a == j for a in head])) if head else 0.0
    return out


def multi_version_rows(batch: DataProto) -> float:
    """The share of rows whose policy tokens were sampled by more than one policy version (partial rollouts)."""
    versions, mask = batch.batch["rollout_versions"], batch.batch["response_mask"].bool()
    big = torch.iinfo(versions.dtype).max
    oldest = torch.where(mask, versions, torch.full_like(versions, big)).min(-1).values
    newest = torch.where(mask, versions, torch.full_like(versions, -1)).max(-1).values
    return float(((newest != oldest) & mask.any(-1)).float().mean())


def counted_metrics(counts: collections.Counter) -> dict[str, float]:
    """What was thrown away or lost since the last step (run health sums them, summary.json); resets `counts`."""
    out = {
        sig.STREAM_DROPPED_STALE: float(counts["stale"]),
        "stream/aborted": float(counts["aborted"]),
        sig.STREAM_LOST: float(counts["lost"] + counts["lost_reset"]),
        sig.STREAM_WORKERS_LOST: float(counts["workers_lost"]),
    }
    counts.clear()
    return out


def _ratio(a: list[int], b: list[int]) -> float:
    """Mean turns of admitted over mean turns of finished trajectories, over the run so far (1 = no bias)."""
    if not a[1] or not b[1] or not b[0]:
        return 1.0
    return (a[0] / a[1]) / (b[0] / b[1])
