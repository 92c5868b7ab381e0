"""The token-in / token-out round trip, checked: what a batch trains is what the engine sampled, and what the
environment inserted is what the model's chat template renders.

The rollout appends the engine's sampled ids as they are (rsearch_verl/rollout/agent_loop.py) and encodes each
observation on its own (`observation_ids`); nothing is decoded and re-encoded on the way to the update. This module
re-derives a trajectory from its record and fails loudly (`RoundTripError`, which fails the run) when:

  1. ids: the batch row's prompt, its policy tokens (response_mask 1) and its observation tokens (mask 0) are not, turn
     by turn, exactly the prompt, the ids the engine returned for each turn and the observation ids the loop appended
     (a re-tokenisation, a padding or a concatenation that changed a token trained as the policy's);
  2. template (chat-template runs of a protocol whose observations are the template's tool turn: tool_call): the
     conversation is re-rendered through the tokenizer's chat template, one turn at a time (the protocol's own
     system / user messages and tools, the earlier turns' assistant text and tool results), and each observation's
     text must be exactly what the template writes after that assistant message when the tool message follows, up to
     the next generation prompt (Qwen3's `<think></think>` included). A Llama 3 call ends with the end-of-message
     token the policy sampled (`<|eom_id|>` / `<|eot_id|>`), standing for the template's own `<|eot_id|>`;
  3. tokens: each observation's ids are exactly the template text's own tokens (`tokenizer.encode`).

An observation cut to its token budget (`rollout.max_obs_length`, or the little room left at the end of a row) is
counted and not checked against the template (the cut can fall inside the frame or the marker).

Not a failure, counted (`round_trip/noncanonical_turns`): policy turns whose sampled ids are not the
tokenizer's own encoding of their text (a model may sample `<`, `tool`, `_`, ... where the tokenizer would merge).
Token-in / token-out trains those ids as sampled; any pipeline that decoded and re-encoded the text would change them,
which is what check 1 catches.

Where it runs: `generate_batch_async` (batch mode: every training batch and validation), on the first
`rollout.round_trip_sample` trajectories, when `rollout.round_trip_check` is on (auto: chat-template runs). It
re-renders a few conversations per batch (milliseconds). Trajectories whose context folded (rollout.context) are
skipped (a fold rewrites the context by design). The streaming rollout (trainer.rollout_mode=streaming,
rsearch_verl/rollout/stream.py) checks each finished group's sample the same way; a mismatch fails the run at the
driver's next poll.

    metrics = check_round_trip(trajs, batch, tokenizer, protocol, sample=4)   # raises RoundTripError
"""

from __future__ import annotations

from typing import Any

from verl import DataProto

MARK = "\u2063ASSISTANT-TURN\u2063"  # stands for the assistant message whose following text is checked


class RoundTripError(RuntimeError):
    """The trained ids are not the sampled ones, or an observation is not what the chat template renders."""


def round_trip_enabled(cfg) -> bool:
    """`rollout.round_trip_check`: on | off | auto (on exactly when prompts go through the chat template)."""
    mode = cfg.rollout.round_trip_check
    return mode == "on" or (mode == "auto" and cfg.prompt_variant == "instruct")


def check_round_trip(trajs: list, batch: DataProto, tokenizer, protocol, sample: int = 4) -> dict[str, float]:
    """Check the first `sample` (-1: all) unfolded trajectories of `trajs` against their rows of `batch` (built from
    them by `trajectories_batch`); raise RoundTripError on the first mismatch; return the check's metrics."""
    rows = [0]
    for traj in trajs:
        rows.append(rows[-1] + len(traj.rows))
    chosen = [i for i, t in enumerate(trajs) if len(t.rows) == 1][: None if sample < 0 else sample]
    template = getattr(protocol, "tool_content", None) is not None and protocol.template_frame is not None
    counts = {"noncanonical": 0, "truncated": 0, "observations": 0}
    for i in chosen:
        where = f"trajectory {i} (uid {batch.non_tensor_batch['uid'][rows[i]]})"
        _check_ids(trajs[i], batch, rows[i], where)
        counts["noncanonical"] += sum(_noncanonical(tokenizer, t.policy_ids) for t in trajs[i].turns)
        if template:
            obs, cut = _check_template(trajs[i], tokenizer, protocol, where)
            counts["observations"] += obs
            counts["truncated"] += cut
    return {
        "round_trip/trajectories": float(len(chosen)),
        "round_trip/observations": float(counts["observations"]),
        "round_trip/truncated_observations": float(counts["truncated"]),
        "round_trip/noncanonical_turns": float(counts["noncanonical"]),
    }


def _check_ids(traj, batch: DataProto, row: int, where: str) -> None:
    """Check 1: the batch row holds the prompt, then each turn's sampled ids (mask 1) and observation ids (mask 0)."""
    t = batch.batch
    p = t["prompts"].shape[1]
    attention = t["attention_mask"][row].tolist()
    prompt = [x for x, a in zip(t["prompts"][row].tolist(), attention[:p], strict=True) if a]
    n = sum(attention[p:])
    ids, mask = t["responses"][row, :n].tolist(), t["response_mask"][row, :n].tolist()
    if prompt != list(traj.prompt_ids):
        raise RoundTripError(f"{where}: the trained prompt ids are not the rendered prompt's ids")
    at = 0
    for k, turn in enumerate(traj.turns):
        for label, want, m in (("policy", turn.policy_ids, 1), ("observation", turn.obs_ids, 0)):
            got = ids[at : at + len(want)]
            if got != list(want) or any(x != m for x in mask[at : at + len(want)]):
                diff = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(got))
                raise RoundTripError(
                    f"{where}, turn {k}: the trained {label} ids differ from the ids the "
                    f"{'engine sampled' if m else 'environment appended'} at token {diff} (trained "
                    f"{got[diff : diff + 4]}, expected {list(want[diff : diff + 4])}; mask {mask[at : at + 4]}); a "
                    "re-tokenisation or a padding bug would train tokens the policy never sampled"
                )
            at += len(want)
    if at != n:
        raise RoundTripError(f"{where}: the row has {n} response tokens, the turns {at}")


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
