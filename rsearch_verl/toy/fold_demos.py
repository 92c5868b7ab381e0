"""Demonstrations folded the way the rollout folds them, so the warm start teaches the folding step too.

A searched demonstration of a long chain passes the context budget of a long-horizon recipe (rollout.context). Here it
is replayed through the agent loop itself (rsearch_verl/rollout/agent_loop.py `run_trajectory`, whose context window,
rsearch_verl/rollout/context.py, is the one owner of folds): a replay engine writes the demonstration's turns (and,
with the summary strategy, the note of demos.py `hop_notes` -- the newest fact and what is left of the chain -- when
the environment opens one), a replay protocol returns its recorded observations. Each row of the replayed trajectory
becomes one SFT example of token ids and loss weights: the row's context (as the rollout would show it after a fold)
weight 0, the policy's tokens (its notes included) weight 1, observations and markers 0, and an EOS after the last
row's answer.

    demos = fold_demos(demos, cfg, tokenizer, protocol)   # long searched demos -> one example per row
    # {"prompt", "ids": [int], "weights": [float], "searched": True, ...}: rsearch_verl/sft.py trains ids / weights
"""

from __future__ import annotations

import asyncio

from rsearch_verl.config import RSearchConfig
from rsearch_verl.rollout.agent_loop import run_trajectory
from rsearch_verl.rollout.context import NOTE_CLOSE, NOTE_OPEN
from rsearch_verl.rollout.engines.base import GenerationResult, RolloutEngine, SamplingParams
from rsearch_verl.segments import OBSERVATION


class ReplayEngine(RolloutEngine):
    """Writes a demonstration's policy turns one per call; a note when the context ends with the environment's
    `<note>` (`notes[k]`: the state after the k searches so far, one hop each)."""

    def __init__(self, tokenizer, turns: list[str], notes: list[str]):
        self.tokenizer, self.turns, self.notes = tokenizer, turns, notes
        self.next_turn = 0
        self.note_open = tokenizer.encode(NOTE_OPEN, add_special_tokens=False)
        self.version = 0

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, stop: list[str]) -> GenerationResult:
        if prompt_ids[-len(self.note_open) :] == self.note_open:
            note = self.notes[min(self.next_turn, len(self.notes) - 1)]
            text, stop_string = f" {note} {NOTE_CLOSE}", NOTE_CLOSE
        else:
            text = self.turns[min(self.next_turn, len(self.turns) - 1)]
            stop_string = next((s for s in stop if text.endswith(s)), None)
            self.next_turn += 1
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: sampling.max_tokens]
        reason = "stop" if stop_string else "eos"
        return GenerationResult(ids, [0.0] * len(ids), reason, stop_string)

    def load_weights(self, weights, version=None) -> None:  # a replay has no weights
        return None


class ReplayProtocol:
    """The run's protocol, but `observe` returns the demonstration's recorded observations in order."""

    def __init__(self, protocol, observations: list[str]):
        self._protocol, self._observations = protocol, list(observations)

    def __getattr__(self, name):
        return getattr(self._protocol, name)

    async def observe(self, action, search, topk: int) -> str:
        return self._observations.pop(0) if self._observations else ""


def _turns(segments: list) -> tuple[list[str], list[str]]:
    """The demonstration's policy turns (the text between observations; the last one holds the answer) and its
    observations."""
    turns, observations, current = [], [], []
    for role, text in segments:
        if role == OBSERVATION:
            turns.append("".join(current))
            observations.append(text)
            current = []
        else:
            current.append(text)
    turns.append("".join(current))
    return turns, observations


def fold_demo(demo: dict, cfg: RSearchConfig, tokenizer, protocol) -> list[dict]:
    """The SFT examples (one per row) of one searched demonstration replayed under `cfg.rollout.context`."""
    turns, observations = _turns(demo["segments"])
    engine = ReplayEngine(tokenizer, turns, demo["notes"])
    prompt = tokenizer.encode(demo["prompt"], add_special_tokens=False)
    sampling = SamplingParams(temperature=1.0, max_tokens=cfg.rollout.max_tokens_per_turn)
    replay = ReplayProtocol(protocol, observations)
    traj = asyncio.run(run_trajectory(engine, tokenizer, replay, None, prompt, cfg, sampling))
    out = []
    for k, row in enumerate(traj.rows):
        ids = row.prompt_ids + row.response_ids
        weights = [0.0] * len(row.prompt_ids) + [float(m) for m in row.response_mask]
        if k == len(traj.rows) - 1:
            ids, weights = ids + [tokenizer.eos_token_id], weights + [1.0]
        out.append({**demo, "ids": ids, "weights": weights, "row": k})
    return out


def fold_demos(demos: list[dict], cfg: RSearchConfig, tokenizer, protocol) -> list[dict]:
    """Searched demonstrations replayed and split into rows as the rollout would fold them (module docstring);
    answered-at-once ones stay as they are (they never reach the budget)."""
    if cfg.rollout.context.strategy == "none":
        return demos
    out = []
    for demo in demos:
        out.extend(fold_demo(demo, cfg, tokenizer, protocol) if demo["searched"] else [demo])
    return out
