"""The streaming pipeline's resume bookkeeping (trainer.rollout_mode=streaming, docs/async_training.md): which loader
draws still hold a prompt not yet trained, and which of their prompts are trained.

Prompts are drawn from the loader in its order, a loader batch (a *draw*) at a time; which step trains which prompt
depends on which group finishes first, so a checkpoint cannot store "the loader after step t". It stores the loader
before the oldest draw with a prompt not yet trained, plus the prompts drawn after it that are trained
(`resume_state`); a resumed run draws from there again and skips those (`load_state`, `draw`), so every prompt is
trained once across the resume, none twice and none skipped.

    ledger = PromptLedger(loader)
    uids, prompts = ledger.draw()         # the next draw: its prompts not trained before a resume, one DataProto each
    ledger.trained(["uid-3", ...])        # after the update that trained them
    state = ledger.resume_state()         # into the checkpoint
    ledger.load_state(state)              # on resume (or after a rollback: everything not trained is drawn again)
"""

from __future__ import annotations

import dataclasses

from verl import DataProto

from rsearch_verl.data.dataset import PromptLoader


@dataclasses.dataclass
class _Draw:
    loader_before: dict
    uids: list[str]


class PromptLedger:
    def __init__(self, loader: PromptLoader):
        self.loader = loader
        self._draws: dict[int, _Draw] = {}  # draws with a prompt not yet trained
        self._trained: set[str] = set()  # uids trained from those draws
        self._skip: set[str] = set()  # uids a resumed run must not draw again
        self._n_draws = 0

    def draw(self) -> tuple[int, list[DataProto]]:
        """The next loader draw: its number and its prompts (one DataProto each) that were not trained before a
        resume (those count as trained at once)."""
        before = self.loader.state_dict()
        drawn = self.loader.next_batch()
        uids = [str(u) for u in drawn.non_tensor_batch["uid"]]
        number, self._n_draws = self._n_draws, self._n_draws + 1
        self._draws[number] = _Draw(before, uids)
        self._trained.update(u for u in uids if u in self._skip)  # trained before the resume
        self._forget_trained_draws()
        return number, [drawn.select_idxs([j]) for j, u in enumerate(uids) if u not in self._skip]

    def trained(self, uids: list[str]) -> None:
        """These prompts' update is applied: they are used up."""
        self._trained.update(uids)
        self._forget_trained_draws()

    def resume_state(self) -> dict:
        """The loader before the oldest drawn prompt not yet trained, and the prompts drawn after it already trained."""
        if not self._draws:
            return self.loader.state_dict()
        oldest = min(self._draws)
        trained = sorted(u for draw in self._draws.values() for u in draw.uids if u in self._trained)
        return {**self._draws[oldest].loader_before, "trained_uids": trained}

    def load_state(self, state: dict) -> None:
        """Draw from `state` on (a checkpoint's, or this ledger's own after a rollback), skipping its trained uids."""
        self._draws.clear(), self._trained.clear()
        self.loader.load_state_dict(state)
        self._skip = set(state.get("trained_uids", []))

    def open_draws(self) -> int:
        """Draws with a prompt not yet trained (bounded by the prompts in flight: the soak test reads it)."""
        return len(self._draws)

    def _forget_trained_draws(self) -> None:
        """Draws whose every prompt is trained leave the resume state (only from the oldest: it stays a prefix)."""
        while self._draws:
            oldest = min(self._draws)
            if not all(u in self._trained for u in self._draws[oldest].uids):
                return
            self._trained.difference_update(self._draws.pop(oldest).uids)
