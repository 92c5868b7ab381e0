"""Feeding the rollout workers' trajectory streams (trainer.rollout_mode=streaming, docs/async_training.md): which
prompt goes to which worker when, and what happens to the prompts of groups that are lost.

Each live worker gets prompt groups while it has room (`rollout.max_concurrent_trajectories` trajectories in flight
plus one group queued) and the capacity rule lets one start (rsearch_verl/trainer/admission.py `room_to_start`: at
most (max_staleness + 1) x train_batch_size groups started and not yet trained). Prompts come from the ledger's draws
(rsearch_verl/trainer/stream_ledger.py) in loader order; a group that is lost (its worker died, its generation
failed), dropped or aborted puts its prompt back at the front of the queue, counted by why, so every drawn prompt is
trained exactly once or counted and generated again.

    feed = StreamFeed(ledger, cfg, seed_for)
    feed.top_up(workers, outstanding=...)     # submit to the workers with room
    sub = feed.finished(seq)                  # a group came back: None when it was aborted or lost meanwhile
    feed.regenerate([sub], "lost")            # its prompt again, first
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from verl import DataProto

from rsearch_verl.config import RSearchConfig
from rsearch_verl.rollout.stream import SEQ
from rsearch_verl.trainer.admission import room_to_start
from rsearch_verl.trainer.stream_ledger import PromptLedger


@dataclasses.dataclass
class Submitted:
    prompts: DataProto  # one prompt
    draw: int  # which loader draw it came from
    worker: int

    @property
    def uid(self) -> str:
        return str(self.prompts.non_tensor_batch["uid"][0])


class StreamFeed:
    def __init__(self, ledger: PromptLedger, cfg: RSearchConfig, seed_for: Callable[[int], int]):
        self.ledger, self.seed_for = ledger, seed_for
        self.k, self.batch_size, self.n = cfg.trainer.max_staleness, cfg.data.train_batch_size, cfg.rollout.n
        self.per_worker = cfg.rollout.max_concurrent_trajectories + self.n  # trajectories: the pool plus one group
        self.todo: collections.deque[tuple[DataProto, int]] = collections.deque()  # (prompt, draw) not submitted
        self.out: dict[int, Submitted] = {}  # seq -> submitted, not finished
        self.counts = collections.Counter()  # trajectories dropped, aborted, lost: per step (the metrics reset it)
        self._seq = 0

    def top_up(self, workers, outstanding: int) -> None:
        """Submit groups to the live workers with room while the capacity rule lets them start; `outstanding`: the
        groups finished and not yet trained (the ones in flight are `self.out`)."""
        room = room_to_start(len(self.out) + outstanding, self.k, self.batch_size)
        for i in workers.live():
            queued = sum(s.worker == i for s in self.out.values()) * self.n
            batch = []
            while room > 0 and queued + self.n <= self.per_worker:
                prompts, draw = self._next_prompt()
                seq, self._seq = self._seq, self._seq + 1
                # its own dict: the rows of one loader draw share the draw's meta_info
                prompts.meta_info = {**prompts.meta_info, SEQ: seq, "seed": self.seed_for(draw + 1), "validate": False}
                self.out[seq] = Submitted(prompts, draw, i)
                batch.append(prompts)
                queued, room = queued + self.n, room - 1
            if batch:
                workers.call(i, "stream_submit", batch)

    def finished(self, seq: int) -> Submitted | None:
        """The group `seq` came back; None when it was aborted or regenerated meanwhile (its result is ignored)."""
        return self.out.pop(seq, None)

    def regenerate(self, subs: list[Submitted], why: str) -> None:
        """Prompts whose trajectories are lost or unusable go to the front of the queue (counted by `why`)."""
        for sub in subs:
            self.counts[why] += self.n
            self.todo.appendleft((sub.prompts, sub.draw))

    def lost_worker(self, i: int) -> list[Submitted]:
        """Worker `i` is gone: its groups (in flight or queued) are generated again (counted `lost`)."""
        lost = [self.out.pop(seq) for seq in [s for s, sub in self.out.items() if sub.worker == i]]
        self.regenerate(lost, "lost")
        return lost

    def abort(self, workers, seqs: list[int]) -> None:
        """Cancel these groups on their workers and generate their prompts again (counted `aborted`)."""
        by_worker = collections.defaultdict(list)
        for seq in seqs:
            by_worker[self.out[seq].worker].append(seq)
        for i, group in by_worker.items():
            workers.call(i, "stream_abort", group)
            self.regenerate([self.out.pop(seq) for seq in group if seq in self.out], "aborted")

    def reset(self) -> None:
        """Forget every submission and queued prompt (rollback, resume: the ledger draws them again)."""
        self.todo.clear(), self.out.clear()

    def _next_prompt(self) -> tuple[DataProto, int]:
        while not self.todo:
            draw, prompts = self.ledger.draw()
            self.todo.extend((p, draw) for p in prompts)
        return self.todo.popleft()
