"""A rollout worker's trajectory stream (trainer.rollout_mode=streaming, docs/async_training.md): prompts in, whole
finished groups out, a pool of trajectories always in flight.

The stream runs its own event loop on a thread of the rollout worker. `submit` queues prompt groups (one prompt each,
with its `rollout.n` samples); up to `rollout.max_concurrent_trajectories` trajectories generate at once, started in
submission order; a group is *finished* when all its samples are (a GRPO group is never split), and then waits in
the finished queue until the driver `poll`s it. Weight updates land in the engine between two decode steps while the
stream runs (rsearch_verl/rollout/engines/batching.py), so a trajectory that spans an update records each token's
policy version (a partial rollout); each in-flight group reports the version it started with (`start_version`),
which the driver's admission (rsearch_verl/trainer/admission.py) needs to bound staleness.

The engine, the agent loop, the context window and the search client are the batch rollout's
(rsearch_verl/rollout/agent_loop.py): a streamed trajectory is the trajectory a batch would have generated from the
same seed and the same weights, and a sample of each finished group gets the batch's token round-trip check
(rsearch_verl/rollout/round_trip.py): a mismatch fails the run at the driver's next poll.

    stream = TrajectoryStream(engine, tokenizer, cfg, protocol)        # starts its thread
    stream.submit([group_a, group_b])      # DataProto of one prompt each; meta_info: seed, stream_seq
    finished, state = stream.poll(wait_s=0.5)   # finished groups (DataProto each) and the in-flight state
    window = stream.metrics()              # the search window and counters (hands over no group)
    lost = stream.reset()                  # cancel everything in flight (rollback, resume); returns the count
    out = stream.run_batch(prompts)        # a whole batch (validation) on the stream's loop, beside the stream
    stream.close()
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time

from verl import DataProto

from rsearch_verl.config import RSearchConfig
from rsearch_verl.config.context import context_budget
from rsearch_verl.rollout.agent_loop import (
    CountingSearch,
    generate_batch_async,
    run_trajectory,
    search_metrics,
    trajectories_batch,
    trajectory_sampling,
    trajectory_seed,
)
from rsearch_verl.rollout.context import ContextWindow
from rsearch_verl.rollout.engines.base import RolloutEngine
from rsearch_verl.rollout.protocols import SearchProtocol
from rsearch_verl.rollout.round_trip import RoundTripError, check_round_trip, round_trip_enabled
from rsearch_verl.search.process import process_breaker, process_search_client

logger = logging.getLogger(__name__)

SEQ = "stream_seq"  # the driver's submission number of a group, in its prompts' non-tensors and meta_info


@dataclasses.dataclass
class _Group:
    seq: int
    prompts: DataProto  # one prompt, repeated rollout.n times
    task: asyncio.Task | None = None
    start_version: int | None = None  # the engine's version when its first sample started generating


class TrajectoryStream:
    """A pool of trajectories in flight on one engine; see the module docstring."""

    def __init__(self, engine: RolloutEngine, tokenizer, cfg: RSearchConfig, protocol: SearchProtocol, search=None):
        self.engine, self.tokenizer, self.cfg, self.protocol = engine, tokenizer, cfg, protocol
        protocol.bind_tokenizer(tokenizer, chat=cfg.prompt_variant == "instruct")
        self._search = search or process_search_client(cfg.retriever)
        self._breaker = process_breaker(cfg.retriever) if search is None and cfg.retriever.breaker.enable else None
        self._counted = CountingSearch(self._breaker or self._search)
        self._window = ContextWindow(cfg, tokenizer, protocol, context_budget(cfg))
        self._groups: dict[int, _Group] = {}  # submitted, not yet finished (queued or generating)
        self._finished: collections.deque[DataProto] = collections.deque()
        self._failed: list[int] = []  # groups whose generation raised, since the last poll
        self._round_trip = round_trip_enabled(cfg)  # each finished group's sample checked, as a batch's is
        self._fatal: RoundTripError | None = None  # a failed round trip: the next poll raises it (the run fails)
        self._lock = threading.Condition()  # guards _finished and the counters below
        self._busy_s, self._busy_since, self._window_start = 0.0, None, time.perf_counter()
        self._running = 0  # trajectories generating now (holding a slot of the pool)
        self.trajectories_done = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="trajectory-stream", daemon=True)
        self._thread.start()
        self._sem = self._call(self._make_semaphore)

    # ------------------------------------------------------------------ the driver's side (any thread)
    def submit(self, groups: list[DataProto]) -> None:
        """Queue prompt groups; each starts generating as soon as the pool has room (submission order)."""
        for prompts in groups:
            self._call(self._start, prompts)

    def poll(self, wait_s: float = 0.0) -> tuple[list[DataProto], dict]:
        """The groups finished since the last poll (waiting up to `wait_s` for one) and the stream's state:
        `in_flight` [(seq, start_version or None)], `failed` (seqs whose generation raised), `trajectories_in_flight`,
        `busy_s` (seconds with at least one trajectory generating, since start-up). The finished groups and the state
        are read in one step of the stream's loop (a group leaves `in_flight` and joins the finished ones in one step
        too), so every group submitted is in exactly one of them."""
        with self._lock:
            self._lock.wait_for(lambda: self._finished or self._failed or self._fatal, timeout=wait_s)
            if self._fatal is not None:
                raise self._fatal
        return self._call(self._take_finished)

    def metrics(self) -> dict:
        """The search window since the last call, and the counters (`trajectories_done`, `trajectories_in_flight`);
        hands over no group (collecting metrics never polls)."""
        return {"metrics": self._call(self._metrics), **self._call(self._state)}

    def reset(self) -> int:
        """Cancel every group in flight and forget the finished ones; returns the trajectories lost."""
        lost = self._call(self._cancel_all)
        with self._lock:
            lost += sum(len(batch.non_tensor_batch["uid"]) for batch in self._finished)
            self._finished.clear()
        return lost

    def abort(self, seqs: list[int]) -> int:
        """Cancel these groups (too stale to be admitted any more); returns the trajectories lost."""
        return self._call(self._cancel, seqs)

    def run_batch(self, prompts: DataProto, **kwargs) -> DataProto:
        """A whole batch (validation) generated on the stream's loop, beside the groups in flight; its search window
        is its own (the stream's search counters keep counting)."""
        search = CountingSearch(self._breaker or self._search)
        coro = generate_batch_async(self.engine, self.tokenizer, prompts, self.cfg, search, protocol=self.protocol,
                                    **kwargs)  # fmt: skip
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def busy_seconds(self) -> float:
        with self._lock:
            return self._busy_s + (time.perf_counter() - self._busy_since if self._busy_since is not None else 0.0)

    def close(self) -> None:
        if self._loop.is_running():
            self.reset()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the loop's side
    def _call(self, fn, *args):
        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def _make_semaphore(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(max(1, self.cfg.rollout.max_concurrent_trajectories))

    def _start(self, prompts: DataProto) -> None:
        seq = int(prompts.meta_info[SEQ])
        group = _Group(seq, prompts.repeat(repeat_times=self.cfg.rollout.n, interleave=True))
        group.task = self._loop.create_task(self._run_group(group))
        self._groups[seq] = group

    async def _run_group(self, group: _Group) -> None:
        base_seed = int(group.prompts.meta_info["seed"])
        try:
            trajs = await asyncio.gather(*(self._one(group, row, base_seed) for row in range(len(group.prompts))))
        except Exception:  # an engine failure: the driver regenerates the group (counted), the stream goes on
            logger.exception("trajectory stream: group %d failed", group.seq)
            self._groups.pop(group.seq, None)
            with self._lock:
                self._failed.append(group.seq)
                self._lock.notify_all()
            return
        out = trajectories_batch(trajs, group.prompts, self.tokenizer, {SEQ: group.seq})
        self._groups.pop(group.seq, None)
        if self._round_trip:  # the trained ids are the sampled ones, observations the template's
            try:
                check_round_trip(trajs, out, self.tokenizer, self.protocol, self.cfg.rollout.round_trip_sample)
            except RoundTripError as err:
                with self._lock:
                    self._fatal = err
                    self._lock.notify_all()
                return
        with self._lock:
            self.trajectories_done += len(trajs)
            self._finished.append(out)
            self._lock.notify_all()

    async def _one(self, group: _Group, row: int, base_seed: int):
        nt = group.prompts.non_tensor_batch
        sampling = trajectory_sampling(self.cfg, False, trajectory_seed(base_seed, str(nt["uid"][row]), row))
        async with self._sem:
            if group.start_version is None:
                group.start_version = self.engine.version
            self._generating(+1)
            try:
                return await run_trajectory(self.engine, self.tokenizer, self.protocol, self._counted,
                                            list(nt["prompt_ids"][row]), self.cfg, sampling, self._window)  # fmt: skip
            finally:
                self._generating(-1)

    def _generating(self, delta: int) -> None:
        """Count the trajectories generating; the busy clock runs while there is at least one."""
        with self._lock:
            self._running += delta
            now = time.perf_counter()
            if self._running > 0 and self._busy_since is None:
                self._busy_since = now
            elif self._running == 0 and self._busy_since is not None:
                self._busy_s += now - self._busy_since
                self._busy_since = None

    def _take_finished(self) -> tuple[list[DataProto], dict]:
        """On the loop: the finished and failed groups and the in-flight state, together (see `poll`)."""
        with self._lock:
            finished, self._finished = list(self._finished), collections.deque()
            failed, self._failed = self._failed, []
        return finished, {**self._state(), "failed": failed}

    def _state(self) -> dict:
        groups = sorted(self._groups.values(), key=lambda g: g.seq)
        return {
            "in_flight": [(g.seq, g.start_version) for g in groups],
            "trajectories_in_flight": self._running,
            "queued_groups": sum(g.start_version is None for g in groups),
            "busy_s": self.busy_seconds(),
            "trajectories_done": self.trajectories_done,
            "version": self.engine.version,
        }

    def _metrics(self) -> dict[str, float]:
        now = time.perf_counter()
        wall, self._window_start = now - self._window_start, now
        out = search_metrics(self._search, self._counted, wall, self._breaker)
        self._counted.reset()
        return out

    def _cancel(self, seqs: list[int]) -> int:
        lost = 0
        for seq in seqs:
            group = self._groups.pop(seq, None)
            if group is not None:
                group.task.cancel()
                lost += len(group.prompts)
        return lost

    def _cancel_all(self) -> int:
        return self._cancel(list(self._groups))
