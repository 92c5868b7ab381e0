"""Streaming rollouts (trainer.rollout_mode=streaming, docs/async_training.md): trajectories, not batches, flow from
the split rollout workers to the trainer.

The pipeline keeps every live rollout worker's trajectory stream (rsearch_verl/rollout/stream.py) fed with prompt
groups; a step's batch is `data.train_batch_size` whole groups that `trainer.staleness_rule` admits
(rsearch_verl/trainer/admission.py: `admission`, the default, bounds staleness where a group starts and trains the
oldest finished groups without waiting for any; `oldest_token` bounds every admitted token's age and waits for due
groups); the others keep generating across the weight update (partial rollouts, per-token versions). One concern a
module:

    stream_feed.py      which prompt goes to which worker when; lost / dropped prompts generated again
    stream_ledger.py    resume bookkeeping: every drawn prompt trained once across a resume
    stream_workers.py   calls that survive a dead worker, polling (the only call that hands groups over)
    stream_metrics.py   the step's metrics (never polls)

Which step trains which prompt depends on which group finishes first, so it is not reproducible across runs, but
every prompt is trained exactly once, or counted lost and generated again. A checkpoint is only ever written between
steps, never with a batch half admitted. A rollout worker that dies (RayActorError) loses only its in-flight groups:
they are counted (`stream/lost_trajectories`, summary.json health) and their prompts go to the other workers; the run
stops only when no rollout worker is left. The step's batch is joined by `rsearch_verl.batch.join_rows` (groups
differ in width: folded rows).

    pipeline = StreamingPipeline(groups.rollout, loader, cfg, seed_for)
    batch = pipeline.take(step)        # admitted groups of step; metrics in meta_info["metrics"]
    ... train, push weights ...
    pipeline.applied()
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
from verl import DataProto

from rsearch_verl.batch import join_rows
from rsearch_verl.config import RSearchConfig
from rsearch_verl.data.dataset import PromptLoader
from rsearch_verl.rollout.stream import SEQ
from rsearch_verl.trainer.admission import Candidate, admit, staleness
from rsearch_verl.trainer.prefetch import LogProbPrefetch
from rsearch_verl.trainer.stream_feed import StreamFeed, Submitted
from rsearch_verl.trainer.stream_ledger import PromptLedger
from rsearch_verl.trainer.stream_metrics import StreamMetrics, counted_metrics
from rsearch_verl.trainer.stream_workers import StreamWorkers
from rsearch_verl.workers.generation_group import GenerationGroup

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how long one poll waits for a worker's next finished group
STALL_S = 1800.0  # a step that sees no group finish this long: the rollout workers are stuck, the run stops


class StreamingPipeline:
    def __init__(
        self,
        rollout: GenerationGroup,
        loader: PromptLoader,
        cfg: RSearchConfig,
        seed_for: Callable[[int], int],
        prefetch: LogProbPrefetch | None = None,
    ):
        self.cfg, self.rule = cfg, cfg.trainer.staleness_rule
        self.k, self.batch_size = cfg.trainer.max_staleness, cfg.data.train_batch_size
        self.prefetch = prefetch  # the actor's log-probs of finished groups, computed while a step waits
        self.ledger = PromptLedger(loader)
        self.feed = StreamFeed(self.ledger, cfg, seed_for)
        self.workers = StreamWorkers(rollout)
        self.stats = StreamMetrics(self.k)
        self._done: dict[int, tuple[Submitted, DataProto, Candidate]] = {}  # finished, not admitted
        self._current: list[Submitted] = []  # taken, update not yet applied

    # ------------------------------------------------------------------ the loop's interface
    def take(self, step: int) -> DataProto:
        """Step's batch: `train_batch_size` whole groups the staleness rule admits (module docstring)."""
        start, waits, progress = time.perf_counter(), 0, time.perf_counter()
        while True:
            self._regenerate_lost()
            self.feed.top_up(self.workers, outstanding=len(self._done))
            before = len(self._done)
            self._poll(POLL_S if waits else 0.0)
            if len(self._done) > before:
                progress = time.perf_counter()
            elif time.perf_counter() - progress > STALL_S:
                raise RuntimeError(f"streaming: no group finished in {STALL_S:.0f} s (in flight: "
                                   f"{self._in_flight()}); the rollout workers are stuck")  # fmt: skip
            finished = [c for _, _, c in self._done.values()]
            plan = admit(self.rule, finished, self._in_flight(), step, self.k, self.batch_size)
            self.feed.regenerate([self._done.pop(c.seq)[0] for c in plan.stale], "stale")
            self.feed.abort(self.workers, plan.abort)
            if plan.ready:
                break
            waits += 1
            if self.prefetch is not None and self.prefetch.one(self._in_admission_order(step), step - 1):
                waits = 0  # that took the actor's time: poll at once
        taken = [self._done.pop(c.seq) for c in plan.admitted]
        self._current = [sub for sub, _, _ in taken]
        prefetched = {} if self.prefetch is None else self.prefetch.mark([(c.seq, b) for c, (_, b, _) in zip(
            plan.admitted, taken, strict=True)], step - 1)  # fmt: skip
        batch = self._join([b for _, b, _ in taken])
        queue = {"stream/queue_depth": float(len(self._done)), "stream/groups_in_flight": float(len(self.feed.out))}
        metrics = self.stats.step(step, plan.admitted, batch, time.perf_counter() - start, self.workers.window(), queue)
        batch.meta_info["metrics"] = {**metrics, **counted_metrics(self.feed.counts), **prefetched}
        return batch

    def applied(self) -> None:
        """The taken batch's update is applied: its prompts are used up."""
        self.ledger.trained([sub.uid for sub in self._current])
        self._current = []

    def resume_state(self) -> dict:
        """The loader before the oldest drawn prompt not yet trained, and the prompts drawn after it already trained."""
        return self.ledger.resume_state()

    def load_state(self, state: dict) -> None:
        self.ledger.load_state(state)

    def discard(self) -> None:
        """Forget everything not yet trained (rollback, resume): cancel the streams, rewind the loader."""
        state = self.ledger.resume_state()
        self.feed.counts["lost_reset"] += len(self._done) * self.feed.n + self.workers.reset()  # never trained
        self.feed.reset()
        self._done.clear()
        if self.prefetch is not None:
            self.prefetch.forget()
        self._current = []
        self.ledger.load_state(state)

    # ------------------------------------------------------------------ reading the streams
    def _poll(self, wait_s: float) -> None:
        """Collect finished and failed groups from every live worker (waiting up to `wait_s` in all)."""
        for _, finished, state in self.workers.poll(wait_s):
            for batch in finished:
                self._finish(batch)
            failed = [sub for sub in map(self.feed.finished, state.get("failed", [])) if sub is not None]
            self.feed.regenerate(failed, "lost")  # the worker logged why

    def _finish(self, batch: DataProto) -> None:
        seq = int(batch.meta_info[SEQ])
        sub = self.feed.finished(seq)
        if sub is None:  # aborted or regenerated meanwhile
            return
        versions, mask = batch.batch["rollout_versions"], batch.batch["response_mask"].bool()
        oldest = int(versions[mask].min()) if mask.any() else int(versions.max().clamp(min=0))
        newest = int(versions[mask].max()) if mask.any() else oldest
        last = np.array([bool(x) for x in batch.non_tensor_batch["last_segment"]])
        turns = tuple(int(t) for t in batch.non_tensor_batch["n_turns"][last])
        self.stats.finished(turns)
        self._done[seq] = (sub, batch, Candidate(seq, oldest, turns, newest))

    def _regenerate_lost(self) -> None:
        """The groups a dead worker had (in flight or queued, not yet polled) go to the live ones (counted)."""
        for i in self.workers.newly_dead():
            lost = self.feed.lost_worker(i)
            logger.error("rollout worker %d is gone: its %d trajectories in flight are generated again", i,
                         len(lost) * self.feed.n)  # fmt: skip
            self.feed.counts["workers_lost"] += 1

    def _in_flight(self) -> list[tuple[int, int | None]]:
        return self.workers.all_in_flight(self.feed.out)

    def _in_admission_order(self, step: int) -> list[tuple[int, DataProto]]:
        """The finished groups (seq, batch) as the admission would take them."""
        if self.rule == "admission":
            key = lambda kv: (kv[1][2].oldest_version, kv[0])  # noqa: E731
        else:  # due first, then by submission
            key = lambda kv: (staleness(step, kv[1][2].oldest_version) < self.k, kv[0])  # noqa: E731
        return [(seq, batch) for seq, (_, batch, _) in sorted(self._done.items(), key=key)]

    def _join(self, batches: list[DataProto]) -> DataProto:
        for b in batches:
            b.meta_info = {}
        return join_rows(batches)
