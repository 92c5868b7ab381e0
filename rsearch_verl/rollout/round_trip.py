"""The token-in / token-out round trip, checked: what the actor trains is what the engine sampled, and what the
environment inserted is what the model's chat template renders.

The reference is the trajectory's `EngineRecord`, taken at the engine boundary (rsearch_verl/rollout/agent_loop.py,
the summary fold of rsearch_verl/rollout/context.py): where each `engine.generate` is called, a digest of the context
it is handed; where it returns, an immutable copy (a tuple) of the sampled ids; where the environment makes an
observation's ids, a tuple of those. No list on the way to the batch is one of these tuples, so no re-tokenisation,
concatenation or padding on that way can change the reference along with the copy it checks. What is checked is
what the update reads: the batch tensors (`input_ids`, `attention_mask`, `position_ids`, `responses`,
`response_mask`, `prompts`). `check_round_trip` fails loudly (`RoundTripError`, which fails the run) when:

  1. ids (every row of the sampled trajectories, folded ones included): the row's real tokens are not one run (a
     left-padded prompt, a right-padded response) at positions 0..n-1 with `input_ids` = prompts ‖ responses; or each
     context the engine was handed is not exactly the row's first tokens up to that point; or the policy tokens
     (response_mask 1) and observation tokens (mask 0) are not, in order, the recorded sampled and inserted ids;
  2. template (unfolded trajectories of a chat-template run whose protocol's observations are the template's tool
     turn: tool_call): the conversation is re-rendered through the tokenizer's chat template, one turn at a time (the
     protocol's own system / user messages and tools, the earlier turns' assistant text and tool results), and each
     observation's text must be exactly what the template writes after that assistant message when the tool message
     follows, up to the next generation prompt (Qwen3's `<think></think>` included). A Llama 3 call ends with the
     end-of-message token the policy sampled (`<|eom_id|>` / `<|eot_id|>`), standing for the template's `<|eot_id|>`;
  3. tokens: each observation's ids are exactly the template text's own tokens (`tokenizer.encode`).

An observation cut to its token budget (`rollout.max_obs_length`, or the little room left at the end of a row) is
counted and not checked against the template (the cut can fall inside the frame or the marker).

Not a failure, counted (`round_trip/noncanonical_turns`): sampled generations whose ids are not the tokenizer's own
encoding of their text (a model may sample `<`, `tool`, `_`, ... where the tokenizer would merge). Token-in /
token-out trains those ids as sampled; a pipeline that decoded and re-encoded the text would change them, which is
what check 1 catches.

Where it runs: in the rollout worker, on the batch `trajectories_batch` built (`generate_batch_async`, batch mode:
every training batch and validation; the streaming rollout, rsearch_verl/rollout/stream.py: each finished group, a
mismatch failing the run at the driver's next poll), on the first `rollout.round_trip_sample` trajectories, when
`rollout.round_trip_check` is on (auto: chat-template runs). The rows it checked carry their record in the batch
(non-tensor `round_trip_record`, None on the other rows), and the driver checks them again on the batch the update
gets, after the chunks were joined, trimmed and padded (`check_batch_records`; rsearch_verl/trainer/phases.py
`round_trip_phase`). It costs a digest per generation and a few re-rendered conversations per batch (milliseconds).

    metrics = check_round_trip(trajs, batch, tokenizer, protocol, sample=4)   # raises RoundTripError
    rows, tokens = check_batch_records(final_batch)                          # the driver's check, raises too
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from verl import DataProto

MARK = "\u2063ASSISTANT-TURN\u2063"  # stands for the assistant message whose following text is checked
RECORD = "round_trip_record"  # non-tensor key: a checked row's engine record (tuple of entries), None on other rows
CONTEXT, SAMPLED, INSERTED = "context", "sampled", "inserted"  # the record's entry kinds


class RoundTripError(RuntimeError):
    """The trained ids are not the sampled ones, or an observation is not what the chat template renders."""


def ids_digest(ids) -> int:
    """crc32 of token ids as int64 (a list or a 1-D long tensor): how the record keeps the contexts it saw."""
    array = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids, dtype=np.int64)
    return zlib.crc32(np.ascontiguousarray(array, dtype=np.int64).tobytes())


@dataclass
class EngineRecord:
    """What crossed the engine boundary in one trajectory, row by row (module docstring): entries (row, kind, payload)
    with payload (length, digest) for a CONTEXT handed to the engine and a tuple of ids for SAMPLED / INSERTED ids."""

    entries: list[tuple[int, str, tuple]] = field(default_factory=list)

    def context(self, row: int, ids: list[int]) -> None:
        """Before `engine.generate(ids, ...)`, in training row `row`."""
        self.entries.append((row, CONTEXT, (len(ids), ids_digest(ids))))

    def sampled(self, row: int, ids) -> None:
        """Where the engine returned: a copy of the GenerationResult's ids that nothing downstream holds."""
        self.entries.append((row, SAMPLED, tuple(int(t) for t in ids)))

    def inserted(self, row: int, ids) -> None:
        """Where the environment made ids the row appends with mask 0 (an observation, a note's opening tag)."""
        self.entries.append((row, INSERTED, tuple(int(t) for t in ids)))

    def of_row(self, row: int) -> tuple[tuple[str, tuple], ...]:
        return tuple((kind, payload) for r, kind, payload in self.entries if r == row)

    def sampled_ids(self) -> list[tuple[int, ...]]:
        return [payload for _, kind, payload in self.entries if kind == SAMPLED]


def round_trip_enabled(cfg) -> bool:
    """`rollout.round_trip_check`: on | off | auto (on exactly when prompts go through the chat template)."""
    mode = cfg.rollout.round_trip_check
    return mode == "on" or (mode == "auto" and cfg.prompt_variant == "instruct")


def check_round_trip(trajs: list, batch: DataProto, tokenizer, protocol, sample: int = 4) -> dict[str, float]:
    """Check the first `sample` (-1: all) trajectories of `trajs` on their rows of `batch` (built from them by
    `trajectories_batch`): their rows get their engine records (`RECORD`, which the driver checks again) and are
    checked on the batch tensors (check 1), the unfolded ones' observations against the chat template (checks 2, 3).
    Raise RoundTripError on the first mismatch; return the check's metrics."""
    chosen = range(len(trajs))[: None if sample < 0 else sample]
    offsets = attach_records(batch, trajs, chosen)
    rows, tokens = check_batch_records(batch)
    template = getattr(protocol, "tool_content", None) is not None and protocol.template_frame is not None
    counts = {"noncanonical": 0, "truncated": 0, "observations": 0}
    for i in chosen:
        counts["noncanonical"] += sum(_noncanonical(tokenizer, ids) for ids in trajs[i].record.sampled_ids())
        if template and len(trajs[i].rows) == 1:  # a fold rewrites the context by design: no conversation to render
            where = f"trajectory {i} (uid {batch.non_tensor_batch['uid'][offsets[i]]})"
            obs, cut = _check_template(trajs[i], tokenizer, protocol, where)
            counts["observations"] += obs
            counts["truncated"] += cut
    return {
        "round_trip/trajectories": float(len(chosen)),
        "round_trip/rows": float(rows),
        "round_trip/tokens": float(tokens),
        "round_trip/observations": float(counts["observations"]),
        "round_trip/truncated_observations": float(counts["truncated"]),
        "round_trip/noncanonical_turns": float(counts["noncanonical"]),
    }


def attach_records(batch: DataProto, trajs: list, chosen) -> list[int]:
    """Write `RECORD` into `batch` (whose rows are the segments of `trajs`, in order: `trajectories_batch`): the
    engine record of each row of the trajectories `chosen`, None elsewhere. Returns each trajectory's first row."""
    offsets = [0]
    for traj in trajs:
        offsets.append(offsets[-1] + len(traj.rows))
    if offsets[-1] != len(batch):
        raise RoundTripError(f"the batch has {len(batch)} rows, its trajectories {offsets[-1]}")
    column = np.empty(len(batch), dtype=object)  # None: not checked
    for i in chosen:
        for k in range(len(trajs[i].rows)):
            column[offsets[i] + k] = trajs[i].record.of_row(k)  # element-wise: a tuple is one object here
    batch.non_tensor_batch[RECORD] = column
    return offsets


def check_batch_records(batch: DataProto) -> tuple[int, int]:
    """Check 1 on every row of `batch` that carries its engine record (`RECORD`), on the tensors the update reads,
    whatever joins, trims and padding the batch went through since the rollout; raise RoundTripError on the first
    mismatch. Returns (rows, tokens) checked; (0, 0) without the key (the check is off)."""
    nt = batch.non_tensor_batch
    if RECORD not in nt:
        return 0, 0
    names = nt["traj_id"] if "traj_id" in nt else nt["uid"]
    rows = tokens = 0
    for i, record in enumerate(nt[RECORD]):
        if record is not None:
            tokens += _check_row(batch.batch, i, record, f"row {i} (trajectory {names[i]})")
            rows += 1
    return rows, tokens


def _check_row(t, i: int, record: tuple, where: str) -> int:
    """Check 1 on row `i` of the batch tensors `t`; returns the tokens checked (the row's real tokens)."""
    seq, n_prompt = _trained_tokens(t, i, where)
    response = seq[n_prompt:]
    mask = t["response_mask"][i, : len(response)]
    at, generations = 0, 0
    for kind, payload in record:
        if kind == CONTEXT:
            _check_context(seq, n_prompt + at, payload, f"{where}, turn {generations}")
            generations += 1
            continue
        want, m = torch.tensor(payload, dtype=torch.long), int(kind == SAMPLED)
        got = response[at : at + len(want)]
        if not torch.equal(got, want) or bool((mask[at : at + len(want)] != m).any()):
            diff = next((j for j, (a, b) in enumerate(zip(got.tolist(), payload, strict=False)) if a != b), len(got))
            raise RoundTripError(
                f"{where}, turn {max(generations - 1, 0)}: the trained {'policy' if m else 'observation'} ids differ "
                f"from the ids the {'engine sampled' if m else 'environment appended'} at token {diff} (trained "
                f"{got[diff : diff + 4].tolist()}, expected {list(payload[diff : diff + 4])}; mask "
                f"{mask[at : at + 4].tolist()}); a re-tokenisation or a padding bug would train tokens the policy "
                "never sampled"
            )
        at += len(want)
    if at != len(response):
        raise RoundTripError(f"{where}: the row trains {len(response)} response tokens, the engine record has {at}")
    return len(seq)


def _trained_tokens(t, i: int, where: str) -> tuple[torch.Tensor, int]:
    """Row `i`'s real tokens as the update reads them, and how many are prompt: the attention mask must be one run (a
    left-padded prompt, a right-padded response), `input_ids` prompts ‖ responses on it, `position_ids` 0..n-1."""
    p, r = t["prompts"].shape[1], t["responses"].shape[1]
    if t["input_ids"].shape[1] != p + r:
        raise RoundTripError(f"{where}: input_ids are {t['input_ids'].shape[1]} wide, prompts ‖ responses {p + r}")
    real = t["attention_mask"][i].bool()
    n_prompt, n_resp = int(real[:p].sum()), int(real[p:].sum())
    span = slice(p - n_prompt, p + n_resp)
    if not bool(real[span].all()):
        raise RoundTripError(f"{where}: the attention mask is not a left-padded prompt then a right-padded response "
                             "(a padding bug: the update would read padding as tokens)")  # fmt: skip
    seq = torch.cat([t["prompts"][i], t["responses"][i]])[span]
    if not torch.equal(t["input_ids"][i, span], seq):
        raise RoundTripError(f"{where}: the input_ids the update reads are not the row's prompt and response ids")
    if not torch.equal(t["position_ids"][i, span], torch.arange(len(seq), dtype=t["position_ids"].dtype)):
        raise RoundTripError(f"{where}: the position ids are not 0..{len(seq) - 1} on the row's real tokens")
    return seq, n_prompt


def _check_context(seq: torch.Tensor, before: int, payload: tuple[int, int], where: str) -> None:
    """The context the engine was handed is the row's first `before` trained tokens (its prompt and what it added)."""
    length, digest = payload
    if length != before or ids_digest(seq[:length]) != digest:
        raise RoundTripError(
            f"{where}: the engine sampled after a context of {length} tokens that is not what the row trains before "
            f"its tokens ({before}: its prompt and the ids it appended so far); a context re-tokenised or rebuilt "
            "from text between turns trains ids the engine never saw"
        )


def _noncanonical(tokenizer, ids: list[int]) -> bool:
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False) != list(ids)


def _check_template(traj, tokenizer, protocol, where: str) -> tuple[int, int]:
    """Checks 2 and 3 for every observation of `traj`; returns (observations checked, truncated ones)."""
    messages: list[dict[str, str]] = list(protocol.build_prompt("question", "instruct"))
    ends = tuple(protocol.format.sampled_turn_ends)
    checked = cut = 0
    for k, turn in enumerate(traj.turns):
        if not turn.obs_ids:
            continue
        observed = tokenizer.decode(turn.obs_ids, skip_special_tokens=False)
        content = protocol.tool_content(observed)
        if turn.obs_cut:  # cut to its budget, maybe into its frame or marker: what the template would write is moot
            cut += 1
            messages += [_assistant(tokenizer.decode(turn.policy_ids, skip_special_tokens=True)), _tool(observed)]
            continue
        if content is None:
            raise RoundTripError(f"{where}, turn {k}: the observation is not framed as the chat template frames a tool "
                                 f"result: {observed[:160]!r}")  # fmt: skip
        expected = _rendered_after(tokenizer, protocol, [*messages, _assistant(MARK), _tool(content)])
        last = tokenizer.decode(turn.policy_ids[-1:], skip_special_tokens=False)
        if last in ends:  # the policy closed its own message (Llama 3): the template's end token is that one
            end = next((e for e in ends if expected.startswith(e)), None)
            expected = expected[len(end) :] if end else expected
        if observed != expected:
            raise RoundTripError(
                f"{where}, turn {k}: the observation is not what the chat template renders after the assistant "
                f"message:\n  inserted: {observed!r}\n  template: {expected!r}"
            )
        if tokenizer.encode(expected, add_special_tokens=False) != list(turn.obs_ids):
            raise RoundTripError(f"{where}, turn {k}: the observation's ids are not the template text's tokens")
        checked += 1
        messages += [_assistant(tokenizer.decode(turn.policy_ids, skip_special_tokens=True)), _tool(content)]
    return checked, cut


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def _tool(content: str) -> dict[str, str]:
    return {"role": "tool", "content": content}


def _rendered_after(tokenizer, protocol, messages: list[dict[str, Any]]) -> str:
    """What the chat template writes after the assistant message MARK, to the end of the generation prompt."""
    text = tokenizer.apply_chat_template(
        messages, tools=protocol.tools or None, add_generation_prompt=True, tokenize=False,
        **protocol.chat_template_kwargs,
    )  # fmt: skip
    if text.count(MARK) != 1:
        raise RoundTripError("the chat template does not render an assistant message's content as given")
    return text.split(MARK, 1)[1]
