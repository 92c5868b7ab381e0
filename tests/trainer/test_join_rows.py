"""`join_rows` (rsearch_verl/batch.py), the one owner of a batch's row widths: chunks padded to their own widest
rows (a folded row's prompt is wider than data.max_prompt_length, a note's response wider than
rollout.max_response_length) join into one batch whose every row keeps its real tokens, masks, log-probs and versions.

Run: .venv/bin/python -m pytest -q tests/trainer/test_join_rows.py
"""

from __future__ import annotations

import numpy as np
import torch
from verl import DataProto

from rsearch_verl.batch import join_rows
from rsearch_verl.rollout.trajectory import Trajectory, rows_to_batch

PAD = 0


def _chunk(rows: list[tuple[int, list[tuple[int, int]]]], tag: str) -> DataProto:
    """A chunk of trajectories: each (prompt length, [(policy tokens, observation tokens), ...]) of one row."""
    trajs = []
    for i, (prompt_len, turns) in enumerate(rows):
        traj = Trajectory([10 + i] * prompt_len)
        for j, (policy, obs) in enumerate(turns):
            traj.add([20 + j] * policy, 1, [-0.1 * (j + 1)] * policy, "policy", "p", [j] * policy)
            traj.add([30 + j] * obs, 0, None, "observation", "o")
        trajs.append(traj)
    uids = np.array([f"{tag}{i}" for i in range(len(rows))], dtype=object)
    tensors, non_tensors = rows_to_batch(trajs, {"uid": uids}, PAD)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"metrics": {"x": 1.0}})


def _real(batch: DataProto, i: int) -> dict[str, list]:
    """Row i's real tokens: prompt ids, response ids, masks, log-probs, versions (padding stripped)."""
    t, p = batch.batch, batch.batch["prompts"].shape[1]
    attn = t["attention_mask"][i].bool()
    resp = attn[p:]
    return {
        "prompt": t["prompts"][i][attn[:p]].tolist(),
        "response": t["responses"][i][resp].tolist(),
        "mask": t["response_mask"][i][resp].tolist(),
        "logp": t["rollout_log_probs"][i][resp].tolist(),
        "versions": t["rollout_versions"][i][resp].tolist(),
        "input": t["input_ids"][i][attn].tolist(),
    }


def test_chunks_of_different_widths_join_with_every_real_token_kept():
    narrow = _chunk([(3, [(2, 1)]), (5, [(1, 0)])], "a")
    wide = _chunk([(40, [(4, 6), (3, 2)]), (7, [(9, 0)])], "b")  # a folded row's context: a wider prompt
    before = [_real(c, i) for c in (narrow, wide) for i in range(len(c))]
    assert narrow.batch["prompts"].shape[1] != wide.batch["prompts"].shape[1]
    out = join_rows([narrow, wide])
    assert out.batch["prompts"].shape[1] == 40 and out.batch["responses"].shape[1] == 15
    assert [_real(out, i) for i in range(len(out))] == before
    t = out.batch
    assert torch.equal(t["input_ids"], torch.cat([t["prompts"], t["responses"]], dim=1))
    assert torch.equal(t["position_ids"], (t["attention_mask"].cumsum(-1) - 1).clamp(min=0))
    pad = ~t["attention_mask"][:, 40:].bool()
    assert (t["rollout_versions"][pad] == -1).all() and (t["response_mask"][pad] == 0).all()
    assert (t["rollout_log_probs"][pad] == 0).all()
    assert list(out.non_tensor_batch["uid"]) == ["a0", "a1", "b0", "b1"]
    assert out.meta_info["metrics"] == {"x": [1.0, 1.0]}  # per-chunk metrics collected as DataProto.concat does


def test_joined_columns_that_are_padding_everywhere_are_trimmed():
    a, b = _chunk([(6, [(2, 0)])], "a"), _chunk([(4, [(3, 1)])], "b")
    a.batch["prompts"] = torch.nn.functional.pad(a.batch["prompts"], (5, 0), value=PAD)  # padded wider than needed
    for key in ("input_ids", "attention_mask", "position_ids"):
        a.batch[key] = torch.nn.functional.pad(a.batch[key], (5, 0), value=0)
    out = join_rows([a, b])
    assert out.batch["prompts"].shape[1] == 6 and out.batch["responses"].shape[1] == 4
