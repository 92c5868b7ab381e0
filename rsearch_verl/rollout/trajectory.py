"""The record of one multi-turn trajectory, and the batch rows it becomes.

A trajectory is one or more rows (rsearch_verl/rollout/context.py decides when it folds): each row is the context it
was generated in (its prompt) and the tokens appended in it, with the response mask (1 = sampled by the policy, 0 =
inserted by the environment), the rollout log-probs and the policy version of each token. A trajectory that never
folds is one row whose prompt is the question's prompt: the batch is then exactly one row per trajectory. Beside the
rows, `record` keeps what crossed the engine boundary, copied where it crossed (rsearch_verl/rollout/round_trip.py):
the reference the token round trip checks the batch against.

`rows_to_batch` turns trajectories into the rollout keys of rsearch_verl/batch.py, one row per segment: tensors from
the rows, trajectory-level non-tensors (the whole response text and segments, searches, opens and pages read, turns,
finish reason, the context statistics) repeated on each of its rows, plus `traj_id`, `segment_index` and
`last_segment`.

    traj = Trajectory(prompt_ids)
    traj.add(ids, 1, logprobs, "policy", text, versions)       # appends to the current row
    traj.open_row(new_context_ids)                            # a fold: the next row's prompt
    traj.record.sampled(traj.row_index, out.token_ids)        # at the engine boundary (the agent loop does this)
    tensors, non_tensors = rows_to_batch(trajs, non_tensors_of_prompts, pad_id)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rsearch_verl.batch import sequence_keys
from rsearch_verl.rollout.context import Row, Turn
from rsearch_verl.rollout.round_trip import EngineRecord


@dataclass
class Trajectory:
    prompt_ids: list[int] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)  # the last one is the row being generated
    turns: list[Turn] = field(default_factory=list)  # the history as generated (what drop_observations rebuilds)
    segments: list[tuple[str, str]] = field(default_factory=list)  # ("policy" | "observation", text): all rows
    n_searches: int = 0
    n_opens: int = 0  # calls of the `open` tool (rollout.tools)
    n_pages_read: int = 0  # document pages those calls returned
    n_search_errors: int = 0  # searches that failed for good (after retries); each became an error observation
    n_search_outages: int = 0  # of those, failures of the backend (timeout, connection, 5xx): not the policy's doing
    n_turns: int = 0
    finish_reason: str = "max_turns"  # one of rsearch_verl.batch.FINISH_REASONS
    turn_timing: list[dict[str, float]] = field(default_factory=list)  # per turn {"gen_s", "search_s"}
    folds: int = 0
    context_lens: list[int] = field(default_factory=list)  # context tokens at each generation (prefill, no cache)
    decode_tokens: int = 0  # tokens generated
    # what crossed the engine boundary, copied there (rollout/round_trip.py): the round-trip check's reference, never
    # one of the lists the rows extend
    record: EngineRecord = field(default_factory=EngineRecord)

    def __post_init__(self):
        if not self.rows:
            self.rows.append(Row(list(self.prompt_ids)))

    @property
    def row(self) -> Row:
        return self.rows[-1]

    @property
    def row_index(self) -> int:
        """The row being generated (what the engine record files its entries under)."""
        return len(self.rows) - 1

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_text(self) -> str:
        return "".join(text for _, text in self.segments)

    def add(self, ids: list[int], mask: int, logprobs: list[float] | None, role: str, text: str,
            versions: list[int] | None = None) -> None:  # fmt: skip
        row = self.row
        row.response_ids.extend(ids)
        row.response_mask.extend([mask] * len(ids))
        row.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        row.versions.extend(versions if versions is not None else [-1] * len(ids))
        self.segments.append((role, text))

    def open_row(self, context_ids: list[int]) -> None:
        self.rows.append(Row(list(context_ids)))

    def count_generation(self, context_len: int, n_new: int) -> None:
        self.context_lens.append(context_len)
        self.decode_tokens += n_new

    def context_stats(self) -> dict[str, float]:
        """Per-trajectory context statistics (the driver aggregates them: `rollout/context_*`)."""
        lens = self.context_lens or [len(self.prompt_ids)]
        return {
            "context_tokens_mean": float(np.mean(lens)),
            "context_tokens_max": float(max(lens)),
            "tokens_processed": float(sum(self.context_lens) + self.decode_tokens),
            "prefill_tokens": float(sum(self.context_lens)),
            "folds": float(self.folds),
        }


def object_array(values: list) -> np.ndarray:
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):  # element-wise: numpy would turn equal-length lists into a 2-D array
        arr[i] = v
    return arr


def _pad_rows(rows: list[Row], pad_id: int):
    """The rows as tensors, padded to the widest prompt (left) and response (right) among them."""
    width_p = max(len(r.prompt_ids) for r in rows)
    width_r = max([len(r.response_ids) for r in rows] + [1])
    b = len(rows)
    prompt_t = torch.full((b, width_p), pad_id, dtype=torch.long)
    prompt_m = torch.zeros((b, width_p), dtype=torch.long)
    resp_t = torch.full((b, width_r), pad_id, dtype=torch.long)
    resp_attn = torch.zeros((b, width_r), dtype=torch.long)
    resp_mask = torch.zeros((b, width_r), dtype=torch.long)
    logp = torch.zeros((b, width_r), dtype=torch.float32)
    versions = torch.full((b, width_r), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        p = r.prompt_ids
        prompt_t[i, width_p - len(p) :] = torch.tensor(p, dtype=torch.long)
        prompt_m[i, width_p - len(p) :] = 1
        n = len(r.response_ids)
        if n:
            resp_t[i, :n] = torch.tensor(r.response_ids, dtype=torch.long)
            resp_attn[i, :n] = 1
            resp_mask[i, :n] = torch.tensor(r.response_mask, dtype=torch.long)
            logp[i, :n] = torch.tensor(r.logprobs, dtype=torch.float32) * resp_mask[i, :n]
            versions[i, :n] = torch.tensor(r.versions, dtype=torch.long)
    attn = torch.cat([prompt_m, resp_attn], dim=1)
    return {**sequence_keys(prompt_t, resp_t, attn, resp_mask), "rollout_log_probs": logp, "rollout_versions": versions}


def rows_to_batch(trajs: list[Trajectory], non_tensors: dict[str, np.ndarray], pad_id: int):
    """Tensors and non-tensors of the batch, one row per segment (module docstring); `non_tensors` are the prompts'
    (one entry per trajectory), repeated on each of its rows."""
    owner = [i for i, t in enumerate(trajs) for _ in t.rows]
    rows = [r for t in trajs for r in t.rows]
    tensors = _pad_rows(rows, pad_id)
    out = {key: values[owner] for key, values in non_tensors.items()}
    per_traj = {
        "response_text": [t.response_text for t in trajs],
        "segments": [t.segments for t in trajs],
        "n_searches": [t.n_searches for t in trajs],
        "n_opens": [t.n_opens for t in trajs],
        "n_pages_read": [t.n_pages_read for t in trajs],
        "n_turns": [t.n_turns for t in trajs],
        "finish_reason": [t.finish_reason for t in trajs],
        "search_failed": [t.n_search_outages > 0 for t in trajs],
        "turn_timing": [t.turn_timing for t in trajs],
        "context_stats": [t.context_stats() for t in trajs],
    }
    out.update({key: object_array([values[i] for i in owner]) for key, values in per_traj.items()})
    uids = non_tensors["uid"]
    out["traj_id"] = object_array([f"{uids[i]}/{i}" for i in owner])
    out["segment_index"] = object_array([k for t in trajs for k in range(len(t.rows))])
    out["last_segment"] = object_array([k == len(t.rows) - 1 for t in trajs for k in range(len(t.rows))])
    return tensors, out
