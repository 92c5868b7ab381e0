"""Context management of a long-horizon trajectory: THE owner of when a trajectory's context folds, what the new
context is, and so of how a trajectory splits into training rows (segments).

A trajectory generates in a context: its prompt, then what it appended (policy turns and observations). Before each
turn the window checks that the context, plus the turn's own new tokens, stays within the budget
(`rollout.context.max_tokens`, or the model's positions: rsearch_verl/config/context.py). When it would not:

    none               the trajectory ends (finish_reason "context", counted): one growing sequence, never run past
                       the model's positions
    drop_observations  the context is rebuilt as the prompt and the history with older observations replaced by a
                       short marker (the newest `keep_recent_turns` turns keep theirs: the next turn reads them);
                       when markers are not enough the oldest turns go too, behind one marker
    summary            the environment opens a note (`<note>`, mask 0), the policy writes it (policy tokens, trained)
                       up to `</note>`, and the new context is the prompt and the note alone (MEM1 / ReSum-style)

A fold closes the current row: each row is (the context it was generated in, the tokens appended in it), so every
token is trained exactly once, in the context the policy saw when it sampled it; policy tokens copied into a later
context are that row's prompt and get no loss there. The rows of one trajectory share its outcome reward and
advantage (rsearch_verl/trainer/phases.py).

    window = ContextWindow(cfg, tokenizer, protocol, budget)
    room = window.turn_room(traj)            # new tokens this turn may have (<= 0: fold first, or end)
    await window.fold(traj, engine, sampling)  # closes the row, opens one with the new context
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rsearch_verl.config import RSearchConfig
from rsearch_verl.segments import OBSERVATION, POLICY

NOTE_OPEN, NOTE_CLOSE = "<note>", "</note>"  # the summary strategy's note (policy text inside)
OMITTED = "[omitted]"  # what a dropped observation (or the oldest turns) becomes, inside the protocol's tags
# Bumped whenever a fold builds a different context for the same config (2: the newest observations are always kept),
# so that the cached warm starts of folding recipes (their rows replay the folds: rsearch_verl/toy/warm_start.py)
# are rebuilt
FOLD_REVISION = 2


@dataclass
class Row:
    """One training row (segment) of a trajectory: the context it was generated in and the tokens appended in it."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # 1 = sampled by the policy, 0 = inserted
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def context_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


@dataclass
class Turn:
    """One turn of the history as generated: the policy's tokens and the observation appended after them."""

    policy_ids: list[int]
    obs_ids: list[int] = field(default_factory=list)
    obs_cut: bool = False  # the observation was cut to its token budget (rollout.max_obs_length or the row's room)


class ContextWindow:
    """The context budget of one run's trajectories and the fold of `rollout.context.strategy` (module docstring)."""

    def __init__(self, cfg: RSearchConfig, tokenizer, protocol, budget: int | None):
        self.rc, self.ctx = cfg.rollout, cfg.rollout.context
        self.strategy = self.ctx.strategy
        self.budget = budget if budget is not None else 1 << 30  # unknown model context: the row budget alone
        self.tokenizer, self.protocol = tokenizer, protocol
        marker = (
            f"{protocol.observation_open}{OMITTED}{protocol.observation_close}"
            if protocol.observation_open
            else OMITTED
        )
        self.marker_ids = tokenizer.encode(marker, add_special_tokens=False)
        self.note_open_ids = tokenizer.encode(NOTE_OPEN, add_special_tokens=False)
        self.turn_need = self.rc.max_tokens_per_turn + self.rc.max_obs_length  # a turn and its observation

    # ------------------------------------------------------------------ budgets
    def turn_room(self, traj) -> int:
        """New tokens the next turn may have in the current row: the smaller of the turn's, the row's response budget
        and the context budget (a folding strategy keeps room for the note it may have to write)."""
        row = traj.row
        reserve = self._note_reserve() if self.strategy == "summary" else 0
        return min(
            self.rc.max_tokens_per_turn,
            self.rc.max_response_length - len(row.response_ids),
            self.budget - row.context_len - reserve,
        )

    def context_binds(self, traj) -> bool:
        """Whether the context budget, not the turn's or the row's, is what limits the next turn."""
        row = traj.row
        reserve = self._note_reserve() if self.strategy == "summary" else 0
        own = min(self.rc.max_tokens_per_turn, self.rc.max_response_length - len(row.response_ids))
        return self.budget - row.context_len - reserve < own

    def obs_room(self, traj) -> int:
        """Tokens an observation may have: what the row and the context have left (the turn after it folds)."""
        row = traj.row
        reserve = self._note_reserve() if self.strategy == "summary" else 0
        return min(self.rc.max_response_length - len(row.response_ids), self.budget - row.context_len - reserve)

    def must_fold(self, traj) -> bool:
        """A folding strategy folds before a turn unless the row and the context have room for a whole turn and the
        observation after it (so observations are cut by `max_obs_length` alone, never by the budget)."""
        if self.strategy == "none":
            return False
        return self.obs_room(traj) < self.turn_need

    def _note_reserve(self) -> int:
        return len(self.note_open_ids) + self.ctx.summary_max_tokens

    # ------------------------------------------------------------------ folds
    async def fold(self, traj, engine, sampling) -> bool:
        """Close the current row and open one with the folded context; False when even that does not fit."""
        if self.strategy == "summary":
            new_context = await self._summarise(traj, engine, sampling)
        else:
            new_context = self._dropped_context(traj)
        reserve = self._note_reserve() if self.strategy == "summary" else 0
        if len(new_context) + self.turn_need + reserve > self.budget:
            return False  # no room for a whole turn even after the fold: the trajectory ends in its current row
        traj.open_row(new_context)
        traj.folds += 1
        return True

    def _dropped_context(self, traj) -> list[int]:
        """The prompt, the newest `keep_recent_turns` turns with their observations (the facts the next turn reads)
        and older turns, their observations as markers, as far as the history target allows."""
        # older history fills at most half of what the prompt leaves (so folds are not every turn); the newest turns
        # may use up to the hard limit: a whole turn and its observation must still fit after the fold
        ceiling = min(self.budget, traj.prompt_len + self.rc.max_response_length)
        target = traj.prompt_len + max(0, (ceiling - traj.prompt_len - self.turn_need) // 2)
        limit = ceiling - self.turn_need
        kept: list[list[int]] = []
        used = traj.prompt_len + len(self.marker_ids)  # room for one marker standing for dropped turns
        for age, turn in enumerate(reversed(traj.turns)):
            recent = age < self.ctx.keep_recent_turns
            obs = turn.obs_ids if recent else (self.marker_ids if turn.obs_ids else [])
            if used + len(turn.policy_ids) + len(obs) > (limit if recent else target):
                if recent and obs and used + len(turn.policy_ids) + len(self.marker_ids) <= limit:
                    kept.append(turn.policy_ids + self.marker_ids)  # even this recent observation does not fit
                    used += len(turn.policy_ids) + len(self.marker_ids)
                    continue
                break
            kept.append(turn.policy_ids + obs)
            used += len(turn.policy_ids) + len(obs)
        head = self.marker_ids if len(kept) < len(traj.turns) else []  # all dropped: the prompt and one marker
        return traj.prompt_ids + head + [t for turn in reversed(kept) for t in turn]

    async def _summarise(self, traj, engine, sampling) -> list[int]:
        """The policy writes a note in the current context; the new context is the prompt, the note's opening tag
        (as the environment wrote it) and the note."""
        row = traj.row
        traj.record.inserted(traj.row_index, self.note_open_ids)  # the engine record (rollout/round_trip.py)
        traj.add(self.note_open_ids, 0, None, OBSERVATION, NOTE_OPEN)
        seed = None if sampling.seed is None else (sampling.seed * 31 + 7) % (2**63)  # not the next turn's stream
        params = dataclasses.replace(sampling, max_tokens=self.ctx.summary_max_tokens, seed=seed)
        context = row.context_ids
        traj.record.context(traj.row_index, context)
        out = await engine.generate(context, params, [NOTE_CLOSE])
        traj.record.sampled(traj.row_index, out.token_ids)
        traj.count_generation(row.context_len, len(out.token_ids))
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        versions = list(out.versions) or [engine.version] * len(out.token_ids)
        traj.add(list(out.token_ids), 1, list(out.logprobs), POLICY, text, versions)
        note = self.note_open_ids + list(out.token_ids)
        if out.finish_reason != "stop":  # cut off: close the note so the next context stays well formed
            note += self.tokenizer.encode(NOTE_CLOSE, add_special_tokens=False)
        return traj.prompt_ids + note
