"""Rollout dump: one JSON line per trajectory (docs/architecture.md's contract), for the viewer and debugging.

    write_rollout_dump("outputs/run/rollouts/step_3.jsonl", batch, tokenizer)

Each line: {"uid", "index", "prompt", "response", "response_ids": [int], "response_mask": [0|1], "reward",
"n_searches", "ground_truth", "data_source"} (`index`: the prompt's dataset id, null when the batch has none).
`response_ids` / `response_mask` hold only the real response tokens (padding removed); mask 0 exactly on
observation tokens the environment inserted. A trajectory whose context folded (rollout.context) is one line per row,
each with its own tokens as `response` and `prompt` (the context it was generated in), plus `traj_id` and
`segment_index`. The file is written to a temporary name and renamed, so a reader
never sees half a dump.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
from verl import DataProto


def _plain(value):
    """numpy scalars / arrays and tuples -> JSON types."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (np.ndarray, list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _reward(batch: DataProto, i: int):
    nt = batch.non_tensor_batch
    if "reward" in nt:
        return float(nt["reward"][i])
    if batch.batch is not None and "token_level_scores" in batch.batch.keys():  # noqa: SIM118 - TensorDict
        return float(batch.batch["token_level_scores"][i].sum())
    return None


def dump_rows(batch: DataProto, tokenizer) -> list[dict]:
    """The dump lines of `batch` as dicts (what `write_rollout_dump` writes)."""
    tensors, nt = batch.batch, batch.non_tensor_batch
    width = tensors["responses"].shape[1]
    resp_attn = tensors["attention_mask"][:, -width:]
    rows = []
    for i in range(len(batch)):
        real = resp_attn[i].bool()
        ids = tensors["responses"][i][real].tolist()
        mask = tensors["response_mask"][i][real].tolist()
        # a row of a folded trajectory (rollout/context.py) shows its own context and tokens
        folded = "segment_index" in nt and (int(nt["segment_index"][i]) > 0 or not bool(nt["last_segment"][i]))
        if "raw_prompt" in nt and not folded:
            prompt = str(nt["raw_prompt"][i])
        else:
            prompt_ids = tensors["prompts"][i][tensors["attention_mask"][i, :-width].bool()].tolist()
            prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        response = str(nt["response_text"][i]) if "response_text" in nt and not folded else tokenizer.decode(ids)
        rows.append(
            {
                "uid": str(nt["uid"][i]) if "uid" in nt else str(i),
                "index": _plain(nt["index"][i]) if "index" in nt else None,
                "prompt": prompt,
                "response": response,
                "response_ids": ids,
                "response_mask": mask,
                "reward": _reward(batch, i),
                "n_searches": int(nt["n_searches"][i]) if "n_searches" in nt else 0,
                "ground_truth": _plain(nt["ground_truth"][i]) if "ground_truth" in nt else None,
                "data_source": str(nt["data_source"][i]) if "data_source" in nt else None,
            }
        )
        if folded:
            rows[-1].update(traj_id=str(nt["traj_id"][i]), segment_index=int(nt["segment_index"][i]))
    return rows


def write_rollout_dump(path: str, batch: DataProto, tokenizer) -> str:
    """Write the dump of `batch` to `path` atomically (creating directories); returns `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", suffix=".jsonl", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in dump_rows(batch, tokenizer):
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
