"""Streaming rollouts (trainer.rollout_mode=streaming, docs/async_training.md): trajectories, not batches, flow from
the split rollout workers to the trainer.

The pipeline keeps every live rollout worker's trajectory stream (rsearch_verl/rollout/stream.py) fed with prompt
groups, up to `rollout.max_concurrent_trajectories` trajectories in flight on each (plus one group queued) and at most
(max_staleness + 1) x train_batch_size groups submitted and not yet trained. A step's batch is the first
`data.train_batch_size` groups the admission (rsearch_verl/trainer/admission.py) lets in: whole groups, none over the
staleness bound, the due ones first; the others keep generating across the weight update (partial rollouts).

Prompts are drawn from the loader in its order, a loader batch at a time; which step trains which prompt depends on
which group finishes first, so it is not reproducible across runs, but every prompt is trained once: a checkpoint
stores the loader before the oldest drawn prompt not yet trained plus the prompts after it already trained
(`resume_state`), so a resume generates the untrained ones again and skips the trained ones. A checkpoint is only
ever written between steps, never with a batch half admitted.

A rollout worker that dies (RayActorError) loses only its in-flight groups: they are counted
(`stream/lost_trajectories`, summary.json health) and their prompts go to the other workers; the run stops only when
no rollout worker is left.

    pipeline = StreamingPipeline(groups.rollout, loader, cfg, seed_for)
    batch = pipeline.take(step)        # admitted groups of step; metrics in meta_info["metrics"]
    ... train, push weights ...
    pipeline.applied()
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np
import ray
from verl import DataProto

from rsearch_verl import signals as sig
from rsearch_verl.batch import trim_padding
from rsearch_verl.config import RSearchConfig
from rsearch_verl.data.dataset import PromptLoader
from rsearch_verl.rollout.stream import SEQ
from rsearch_verl.trainer.admission import Candidate, admit, staleness
from rsearch_verl.trainer.prefetch import LogProbPrefetch
from rsearch_verl.workers.generation_group import GenerationGroup
from rsearch_verl.workers.metrics import reduce_metrics

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how long one poll waits for a worker's next finished group
STALL_S = 1800.0  # a step that sees no group finish this long: the rollout workers are stuck, the run stops


@dataclasses.dataclass
class _Submitted:
    prompts: DataProto  # one prompt
    draw: int  # which loader draw it came from
    worker: int


@dataclasses.dataclass
class _Draw:
    loader_before: dict
    uids: list[str]


class StreamingPipeline:
    def __init__(
        self,
        rollout: GenerationGroup,
        loader: PromptLoader,
        cfg: RSearchConfig,
        seed_for: Callable[[int], int],
        prefetch: LogProbPrefetch | None = None,
    ):
        self.rollout, self.loader, self.cfg, self.seed_for = rollout, loader, cfg, seed_for
        self.prefetch = prefetch  # the actor's log-probs of finished groups, computed while a step waits
        self.k, self.batch_size, self.n = cfg.trainer.max_staleness, cfg.data.train_batch_size, cfg.rollout.n
        self.per_worker = cfg.rollout.max_concurrent_trajectories + self.n  # trajectories: the pool plus one group
        self._todo: collections.deque[tuple[DataProto, int]] = collections.deque()  # (prompt, draw) not submitted
        self._out: dict[int, _Submitted] = {}  # seq -> submitted, not finished
        self._done: dict[int, tuple[_Submitted, DataProto, Candidate]] = {}  # finished, not admitted
        self._in_flight: dict[int, list[tuple[int, int | None]]] = {}  # worker -> its stream's in-flight groups
        self._draws: dict[int, _Draw] = {}  # draws with a prompt not yet trained
        self._trained: set[str] = set()  # uids trained from those draws
        self._current: list[_Submitted] = []  # taken, update not yet applied
        self._skip: set[str] = set()  # uids a resumed run must not draw again
        self._seq, self._n_draws = 0, 0
        self._admitted_turns, self._finished_turns = [0, 0], [0, 0]  # (sum, count), for the bias
        self._counts = collections.Counter()  # dropped, aborted, lost: per step, reset by take
        self._rate_since, self._done_before = time.perf_counter(), {}  # trajectories per second: per worker, per step
        self._known_dead: set[int] = set()
        rollout.tolerate_loss()  # a dead rollout worker loses its in-flight groups, not the run

    # ------------------------------------------------------------------ the loop's interface
    def take(self, step: int) -> DataProto:
        """Step's batch: `train_batch_size` whole groups within the staleness bound (module docstring)."""
        start, waits, progress = time.perf_counter(), 0, time.perf_counter()
        while True:
            self._regenerate_lost()
            self._top_up()
            before = len(self._done)
            self._poll(POLL_S if waits else 0.0)
            if len(self._done) > before:
                progress = time.perf_counter()
            elif time.perf_counter() - progress > STALL_S:
                raise RuntimeError(f"streaming: no group finished in {STALL_S:.0f} s (in flight: "
                                   f"{self._all_in_flight()}); the rollout workers are stuck")  # fmt: skip
            plan = admit([c for _, _, c in self._done.values()], self._all_in_flight(), step, self.k, self.batch_size)
            self._regenerate([s for s, _, _ in (self._done.pop(c.seq) for c in plan.stale)], "stale")
            self._abort(plan.abort)
            if plan.ready:
                break
            waits += 1
            if self.prefetch is not None and self.prefetch.one(self._in_admission_order(step), step - 1):
                waits = 0  # that took the actor's time: poll at once
        taken = [self._done.pop(c.seq) for c in plan.admitted]
        self._current = [s for s, _, _ in taken]
        prefetched = {} if self.prefetch is None else self.prefetch.mark([(c.seq, b) for c, (_, b, _) in zip(
            plan.admitted, taken, strict=True)], step - 1)  # fmt: skip
        batch = self._concat([b for _, b, _ in taken])
        batch.meta_info["metrics"] = {**self._metrics(step, plan, time.perf_counter() - start), **prefetched}
        return batch

    def applied(self) -> None:
        """The taken batch's update is applied: its prompts are used up."""
        for sub in self._current:
            self._trained.add(_uid(sub.prompts))
        self._current = []
        self._forget_trained_draws()

    def resume_state(self) -> dict:
        """The loader before the oldest drawn prompt not yet trained, and the prompts drawn after it already trained."""
        if not self._draws:
            return self.loader.state_dict()
        oldest = min(self._draws)
        trained = sorted(u for draw in self._draws.values() for u in draw.uids if u in self._trained)
        return {**self._draws[oldest].loader_before, "trained_uids": trained}

    def load_state(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._skip = set(state.get("trained_uids", []))

    def discard(self) -> None:
        """Forget everything not yet trained (rollback, resume): cancel the streams, rewind the loader."""
        state = self.resume_state()
        self._counts["lost_reset"] += len(self._done) * self.n  # finished, never trained
        for i in self._live():
            self._counts["lost_reset"] += self._call(i, "stream_reset")
        self._todo.clear(), self._out.clear(), self._done.clear(), self._in_flight.clear()
        if self.prefetch is not None:
            self.prefetch.forget()
        self._draws.clear(), self._trained.clear()
        self._current = []
        self.load_state(state)

    # ------------------------------------------------------------------ feeding the streams
    def _top_up(self) -> None:
        """Submit groups to the live workers with room, keeping the submitted-not-trained groups within
        (max_staleness + 1) x train_batch_size."""
        cap = (self.k + 1) * self.batch_size
        for i in self._live():
            outstanding = sum(s.worker == i for s in self._out.values()) * self.n
            batch = []
            while outstanding + self.n <= self.per_worker and len(self._out) + len(self._done) + len(batch) < cap:
                prompts, draw = self._next_prompt()
                seq, self._seq = self._seq, self._seq + 1
                # its own dict: the rows of one loader draw share the draw's meta_info
                prompts.meta_info = {**prompts.meta_info, SEQ: seq, "seed": self.seed_for(draw + 1), "validate": False}
                self._out[seq] = _Submitted(prompts, draw, i)
                batch.append(prompts)
                outstanding += self.n
            if batch:
                self._call(i, "stream_submit", batch)

    def _next_prompt(self) -> tuple[DataProto, int]:
        while not self._todo:
            before = self.loader.state_dict()
            drawn = self.loader.next_batch()
            uids = [str(u) for u in drawn.non_tensor_batch["uid"]]
            self._draws[self._n_draws] = _Draw(before, uids)
            keep = [j for j, u in enumerate(uids) if u not in self._skip]
            self._todo.extend((drawn.select_idxs([j]), self._n_draws) for j in keep)
            self._trained.update(u for u in uids if u in self._skip)  # trained before the resume
            self._n_draws += 1
        return self._todo.popleft()

    def _regenerate(self, subs: list[_Submitted], why: str) -> None:
        """Prompts whose trajectories are lost or unusable go to the front of the queue (counted by `why`)."""
        for sub in subs:
            self._counts[why] += self.n
            self._todo.appendleft((sub.prompts, sub.draw))

    def _abort(self, seqs: list[int]) -> None:
        by_worker = collections.defaultdict(list)
        for seq in seqs:
            by_worker[self._out[seq].worker].append(seq)
        for i, group in by_worker.items():
            self._call(i, "stream_abort", group)
            self._regenerate([self._out.pop(seq) for seq in group], "aborted")

    # ------------------------------------------------------------------ reading the streams
    def _poll(self, wait_s: float) -> None:
        """Collect finished groups from every live worker (waiting up to `wait_s` on each)."""
        live = self._live()
        refs = {i: self.rollout.handle(i).stream_poll.remote(wait_s / max(1, len(live))) for i in live}
        for i, ref in refs.items():
            try:
                finished, state = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                self._lost_worker(i, err)
                continue
            self._in_flight[i] = [tuple(x) for x in state["in_flight"]]
            for batch in finished:
                self._finish(batch)
            failed = [self._out.pop(seq) for seq in state.get("failed", []) if seq in self._out]
            self._regenerate(failed, "lost")  # the worker logged why

    def _finish(self, batch: DataProto) -> None:
        seq = int(batch.meta_info[SEQ])
        sub = self._out.pop(seq, None)
        if sub is None:  # aborted meanwhile
            return
        versions, mask = batch.batch["rollout_versions"], batch.batch["response_mask"].bool()
        oldest = int(versions[mask].min()) if mask.any() else int(versions.max().clamp(min=0))
        last = np.array([bool(x) for x in batch.non_tensor_batch["last_segment"]])
        turns = tuple(int(t) for t in batch.non_tensor_batch["n_turns"][last])
        self._finished_turns[0] += sum(turns)
        self._finished_turns[1] += len(turns)
        self._done[seq] = (sub, batch, Candidate(seq, oldest, turns))

    def _lost_worker(self, i: int, err: Exception) -> None:
        logger.error("rollout worker %d died: %s", i, err)
        self.rollout.mark_dead(i)  # raises when none is left
        self._regenerate_lost()

    def _regenerate_lost(self) -> None:
        """The groups a dead worker had (in flight or queued, not yet polled) go to the live ones (counted)."""
        for i in sorted(self.rollout.dead_workers() - self._known_dead):
            self._known_dead.add(i)
            lost = [seq for seq, s in self._out.items() if s.worker == i]
            logger.error("rollout worker %d is gone: its %d trajectories in flight are generated again", i,
                         len(lost) * self.n)  # fmt: skip
            self._in_flight.pop(i, None)
            self._counts["workers_lost"] += 1
            self._regenerate([self._out.pop(seq) for seq in lost], "lost")

    def _in_admission_order(self, step: int) -> list[tuple[int, DataProto]]:
        """The finished groups (seq, batch) as the admission would take them: due first, then by submission."""
        order = sorted(self._done.items(), key=lambda kv: (staleness(step, kv[1][2].oldest_version) < self.k, kv[0]))
        return [(seq, batch) for seq, (_, batch, _) in order]

    def _all_in_flight(self) -> list[tuple[int, int | None]]:
        return [x for i in self._live() for x in self._in_flight.get(i, []) if x[0] in self._out]

    def _live(self) -> list[int]:
        return self.rollout.live_workers()

    def _call(self, i: int, method: str, *args):
        try:
            return ray.get(getattr(self.rollout.handle(i), method).remote(*args))
        except ray.exceptions.RayActorError as err:
            self._lost_worker(i, err)
            return 0

    def _forget_trained_draws(self) -> None:
        """Draws whose every prompt is trained leave the resume state (only from the oldest: it stays a prefix)."""
        while self._draws:
            oldest = min(self._draws)
            if not all(u in self._trained for u in self._draws[oldest].uids):
                return
            self._trained.difference_update(self._draws.pop(oldest).uids)

    # ------------------------------------------------------------------ the batch and its metrics
    def _concat(self, batches: list[DataProto]) -> DataProto:
        for b in batches:
            b.meta_info = {}
        out = DataProto.concat(batches)
        trim_padding(out.batch)
        return out

    def _metrics(self, step: int, plan, wait_s: float) -> dict[str, float]:
        live = self._live()
        states = {i: self._call(i, "stream_poll", 0.0, True)[1] for i in live}
        per_worker = collections.defaultdict(list)
        for state in states.values():
            for key, value in state.get("metrics", {}).items():
                per_worker[key].append(value)
        metrics = reduce_metrics({"metrics": dict(per_worker)})  # the mean over workers, as a batch's chunks
        for i, state in states.items():
            self._in_flight[i] = [tuple(x) for x in state["in_flight"]]
        now = time.perf_counter()
        done = {i: s.get("trajectories_done", 0) for i, s in states.items()}
        rate = sum(n - self._done_before.get(i, 0) for i, n in done.items()) / max(1e-9, now - self._rate_since)
        self._done_before, self._rate_since = done, now
        ages = [staleness(step, c.oldest_version) for c in plan.admitted]
        turns = [t for c in plan.admitted for t in c.turns]
        self._admitted_turns[0] += sum(turns)
        self._admitted_turns[1] += len(turns)
        metrics.update({
            "stream/queue_depth": float(len(self._done)),
            "stream/groups_in_flight": float(len(self._out)),
            "stream/trajectories_in_flight": float(sum(s.get("trajectories_in_flight", 0) for s in states.values())),
            "stream/wait_s": wait_s,
            "stream/trajectories_per_s": rate,  # finished by the rollout workers since the last step's admission
            "stream/admitted_turns_mean": float(np.mean(turns)) if turns else 0.0,
            "stream/turn_bias": _ratio(self._admitted_turns, self._finished_turns),
            "stream/staleness_max": float(max(ages)),
            **counted_metrics(self._counts),
        })  # fmt: skip
        for j in range(self.k + 1):
            metrics[f"stream/staleness_{j}_frac"] = float(np.mean([a == j for a in ages]))
        return metrics


def counted_metrics(counts: collections.Counter) -> dict[str, float]:
    """What was thrown away or lost since the last step (run health sums them, summary.json); resets `counts`."""
    out = {
        sig.STREAM_DROPPED_STALE: float(counts["stale"]),
        "stream/aborted": float(counts["aborted"]),
        sig.STREAM_LOST: float(counts["lost"] + counts["lost_reset"]),
        sig.STREAM_WORKERS_LOST: float(counts["workers_lost"]),
    }
    counts.clear()
    return out


def _uid(prompts: DataProto) -> str:
    return str(prompts.non_tensor_batch["uid"][0])


def _ratio(a: list[int], b: list[int]) -> float:
    """Mean turns of admitted over mean turns of finished trajectories, over the run so far (1 = no bias)."""
    if not a[1] or not b[1] or not b[0]:
        return 1.0
    return (a[0] / a[1]) / (b[0] / b[1])
