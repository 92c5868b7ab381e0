"""The one batch record of a training step: verl's `DataProto` with these keys (B trajectories, P prompt tokens,
R response tokens). Every phase reads and writes only keys listed here.

Tensors (`batch.batch`):
    prompts            [B, P] long   prompt ids, LEFT-padded with pad_token_id
    responses          [B, R] long   response ids (policy tokens and inserted observation tokens), RIGHT-padded
    input_ids          [B, P+R] long  prompts ‖ responses
    attention_mask     [B, P+R] long  1 on real tokens (prompt, policy and observation), 0 on padding
    position_ids       [B, P+R] long  cumsum(attention_mask) - 1, clipped at 0
    response_mask      [B, R] long   1 = sampled by the policy (trained), 0 = observation inserted by the
                                     environment or padding (no loss, no advantage, no KL, no entropy, no value)
    rollout_log_probs  [B, R] float  log-prob of each sampled token under the rollout engine (0 where mask 0): the
                                     behaviour policy of the off-policy correction (algos/off_policy.py)
    rollout_versions   [B, R] long   policy version (the actor step whose weights the engine had) that sampled
                                     each token; -1 on observations and padding. Tokens of one trajectory differ
                                     when a weight update landed mid-trajectory (trainer.max_staleness >= 1)
    loss_mask          [B, R] long   the positions every loss and the value / advantage chain use: written ONCE by
                                     the driver right after the rollout (`loss_mask` below) and only read after;
                                     = response_mask, or every real response token for the no-masking ablation
                                     (algorithm.mask_observations=false)
    token_level_scores [B, R] float  outcome reward on the last policy token (reward phase)
    old_log_probs      [B, R] float  actor log-probs before the update (actor.compute_log_prob): the proximal
                                     policy of the PPO ratio
    is_weights         [B, R] float  off-policy importance weights on the PPO loss (only with a correction on,
                                     algorithm.off_policy; written by the driver, algos/off_policy.py)
    ref_log_prob       [B, R] float  reference log-probs (compute_ref_log_prob), when KL is used
    values             [B, R] float  critic values (critic.compute_values), PPO only
    token_level_rewards [B, R] float scores minus the in-reward KL penalty (advantage phase)
    advantages, returns [B, R] float (advantage phase)

Non-tensors (`batch.non_tensor_batch`, numpy object arrays of length B):
    uid, index, prompt_ids, raw_prompt, question, ground_truth (list[str]), data_source, extra_info (dict)
        — from the data loader, repeated rollout.n times by the rollout (same uid = same GRPO group)
    response_text   str             decoded response (policy and observation text)
    segments        list[(role, text)]  role "policy" | "observation", in order; joins to response_text
    n_searches, n_turns  int
    n_opens, n_pages_read  int       documents opened / pages read by the `open` tool (runs with rollout.tools
                                    holding open: rollout/tools/open.py)
    finish_reason   str             one of FINISH_REASONS: "answer" | "eos" | "max_turns" | "length" | "stop"
    search_failed   bool            a search failed for an outage reason (timeout, connection, 5xx): with
                                    retriever.breaker.drop_failed the driver zeroes the row's loss_mask
    turn_timing     list[dict]      per turn: {"gen_s", "search_s"}
    context_stats   dict            per trajectory: context_tokens_mean / _max, prefill_tokens, tokens_processed, folds
    traj_id         str             the trajectory a row belongs to: a trajectory whose context folded
                                    (rollout.context, rollout/context.py) is several rows, one per segment, each
                                    with the context it was generated in as its prompt. The trajectory-level keys
                                    above (response_text, segments, n_searches, ..., reward, answer) are repeated on
                                    each of its rows; trajectory statistics read the last row only (`last_rows`)
    segment_index   int             0, 1, ... within the trajectory
    last_segment    bool            the trajectory's last row
    round_trip_record  tuple | None  the engine record of a row the round-trip check sampled (what the engine was
                                    handed and returned: rollout/round_trip.py); None on other rows; re-checked by the
                                    driver before the update
    reward, answer                  (reward phase)

meta_info: `validate` (bool), `seed` (int), `kl_coef` (float, set before the updates), `metrics` (dict, from workers).
"""

from __future__ import annotations

import numpy as np
import torch

# why a trajectory ended (agent loop); "context": its context budget ran out (rollout.context.strategy=none, or a fold
# that could not make room)
FINISH_REASONS = ("answer", "eos", "max_turns", "length", "stop", "context")
TENSOR_KEYS_FROM_ROLLOUT = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rollout_log_probs",
    "rollout_versions",
)


def sequence_keys(
    prompts: torch.Tensor, responses: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The sequence keys of a rollout batch that follow from prompt ids [B, P], response ids [B, R], the attention mask
    [B, P+R] and the response mask [B, R]: `input_ids` is their concatenation, `position_ids` counts attended tokens."""
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
    }


def response_attention(attention_mask: torch.Tensor, response_len: int) -> torch.Tensor:
    """1 on every real response token, observations included (the loss mask of the no-masking ablation)."""
    return attention_mask[:, -response_len:]


def loss_mask(batch_tensors, mask_observations: bool, dropped: torch.Tensor | None = None) -> torch.Tensor:
    """The batch's `loss_mask`: policy tokens only (default) or all real response tokens (ablation), and nothing
    at all in the rows `dropped` ([B] bool: trajectories dropped from the update). The driver calls this once per
    step (trainer/loop.py); actor, critic, KL and advantages read the stored key."""
    mask = batch_tensors["response_mask"]
    if not mask_observations:
        mask = response_attention(batch_tensors["attention_mask"], mask.shape[1]).to(mask.dtype)
    if dropped is not None and bool(dropped.any()):
        mask = mask * (~dropped).to(mask.dtype).unsqueeze(1)
    return mask


def last_rows(non_tensors) -> np.ndarray:
    """[B] bool: the rows that stand for their trajectory (its last segment; every row of a batch without folds)."""
    if "last_segment" not in non_tensors:
        return np.ones(len(non_tensors["uid"]), dtype=bool)
    return np.array([bool(x) for x in non_tensors["last_segment"]], dtype=bool)


def rows_of_trajectories(non_tensors) -> np.ndarray:
    """[B] int: for each row, the position among the batch's last rows of its trajectory's last row."""
    last = last_rows(non_tensors)
    if "traj_id" not in non_tensors:
        return np.arange(len(last))
    ids = non_tensors["traj_id"]
    where = {ids[i]: k for k, i in enumerate(np.flatnonzero(last))}
    return np.array([where[t] for t in ids], dtype=np.int64)


# what a padded position of a [B, R] key holds (every other key: 0; token ids: the batch's own pad id)
_RESPONSE_FILL = {"rollout_versions": -1}
_SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")  # [B, P+R]


def join_rows(batches: list):
    """THE owner of a batch's row widths: the DataProtos of several chunks (the generation workers' chunks, streamed
    groups, validation batches), each padded to its own widest row, joined into one. Every chunk is padded to the
    widest prompt (left) and the widest response (right) among them, concatenated, and the columns that are padding
    in every row are trimmed. A folded row's prompt may be wider than data.max_prompt_length (its context is the
    prompt plus part of the history) and a `summary` row's response wider than rollout.max_response_length (the note),
    so no fixed width holds; nothing else pads rows. Pads the chunks in place."""
    batches = [b for b in batches if len(b)] or batches[:1]
    prompt_width = max(b.batch["prompts"].shape[1] for b in batches)
    response_width = max(b.batch["responses"].shape[1] for b in batches)
    metrics = [b.meta_info.pop("metrics", None) for b in batches]
    for b in batches:
        _pad_to(b.batch, prompt_width, response_width)
    out = type(batches[0]).concat(batches)
    trim_padding(out.batch)
    if any(m is not None for m in metrics):  # per-chunk values, as DataProto.concat collects them
        out.meta_info["metrics"] = _collect_metrics([m for m in metrics if m is not None])
    return out


def _collect_metrics(chunks: list[dict]) -> dict[str, list]:
    """{key: [each chunk's value]} over the keys any chunk has (a chunk may lack one: a rollout worker in streaming
    mode validates on its stream's loop, one that was never sent a group through a plain batch)."""
    out: dict[str, list] = {}
    for chunk in chunks:
        for key, value in chunk.items():
            out.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    return out


def _pad_value(ids: torch.Tensor, real: torch.Tensor) -> int:
    """The pad id a chunk already uses (its token at a padded position), 0 when it has none."""
    padded = ids[~real.bool()]
    return int(padded[0]) if len(padded) else 0


def _pad_to(tensors, prompt_width: int, response_width: int) -> None:
    """Left-pad the prompt side and right-pad the response side of one chunk's keys to the given widths, in place."""
    prompt_len, response_len = tensors["prompts"].shape[1], tensors["responses"].shape[1]
    left, right = prompt_width - prompt_len, response_width - response_len
    if not left and not right:
        return
    attn = tensors["attention_mask"]
    pad_id = _pad_value(tensors["input_ids"], attn)
    for key in list(tensors.keys()):
        value = tensors[key]
        if key == "prompts":
            tensors[key] = torch.nn.functional.pad(value, (left, 0), value=pad_id)
        elif key in _SEQUENCE_KEYS:
            fill = pad_id if key == "input_ids" else 0
            tensors[key] = torch.nn.functional.pad(value, (left, right), value=fill)
        elif value.dim() == 2 and value.shape[1] == response_len:
            fill = pad_id if key == "responses" else _RESPONSE_FILL.get(key, 0)
            tensors[key] = torch.nn.functional.pad(value, (0, right), value=fill)
    if "position_ids" in tensors:  # as the rollout defines them (`sequence_keys`)
        tensors["position_ids"] = (tensors["attention_mask"].cumsum(-1) - 1).clamp(min=0)


def trim_padding(tensors) -> None:
    """Drop the prompt columns that are padding in every row (left) and the response columns that are padding in
    every row (right), in place (`join_rows` pads chunks to a common width first)."""
    prompt_len = tensors["prompts"].shape[1]
    attn = tensors["attention_mask"]
    real_p = attn[:, :prompt_len].any(dim=0).nonzero()
    real_r = attn[:, prompt_len:].any(dim=0).nonzero()
    first = int(real_p[0]) if len(real_p) else prompt_len - 1
    last = int(real_r[-1]) + 1 if len(real_r) else 1
    for key in list(tensors.keys()):
        value = tensors[key]
        if key == "prompts":
            tensors[key] = value[:, first:]
        elif key in ("input_ids", "attention_mask", "position_ids"):
            tensors[key] = torch.cat([value[:, first:prompt_len], value[:, prompt_len : prompt_len + last]], dim=1)
        elif value.dim() == 2 and value.shape[1] == attn.shape[1] - prompt_len:
            tensors[key] = value[:, :last]
