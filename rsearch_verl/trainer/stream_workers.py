"""The rollout workers of a streaming run, as the driver reaches them (trainer.rollout_mode=streaming,
docs/async_training.md): calls that survive a dead worker, polling, and each worker's last known state.

A worker that dies (RayActorError on any call) is marked dead in the generation group and left out from then on;
`newly_dead()` names it once, so the pipeline can generate its groups again; the run stops (RuntimeError from the
group) only when no rollout worker is left. `poll` is the only call that hands finished groups over; `window` reads
the search window and counters and hands over nothing.

    workers = StreamWorkers(groups.rollout)
    for i, finished, state in workers.poll(wait_s=0.2): ...
    for i in workers.newly_dead(): feed.lost_worker(i)
    windows = workers.window()                # {worker: {"metrics": ..., "trajectories_done": ...}}
"""

from __future__ import annotations

import logging

import ray

from rsearch_verl.workers.generation_group import GenerationGroup

logger = logging.getLogger(__name__)


class StreamWorkers:
    def __init__(self, rollout: GenerationGroup):
        self.rollout = rollout
        rollout.tolerate_loss()  # a dead rollout worker loses its in-flight groups, not the run
        self.in_flight: dict[int, list[tuple[int, int | None]]] = {}  # worker -> its stream's groups (last poll)
        self._known_dead: set[int] = set()

    def live(self) -> list[int]:
        return self.rollout.live_workers()

    def call(self, i: int, method: str, *args):
        """`method(*args)` on worker `i`; 0 when the worker is dead (marked, named by `newly_dead`)."""
        try:
            return ray.get(getattr(self.rollout.handle(i), method).remote(*args))
        except ray.exceptions.RayActorError as err:
            self._died(i, err)
            return 0

    def poll(self, wait_s: float) -> list[tuple[int, list, dict]]:
        """(worker, finished groups, state) of every live worker, waiting up to `wait_s` in all."""
        live = self.live()
        refs = {i: self.rollout.handle(i).stream_poll.remote(wait_s / max(1, len(live))) for i in live}
        out = []
        for i, ref in refs.items():
            try:
                finished, state = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                self._died(i, err)
                continue
            self.in_flight[i] = [tuple(x) for x in state["in_flight"]]
            out.append((i, finished, state))
        return out

    def window(self) -> dict[int, dict]:
        """Each live worker's search window since the last call and its counters (no group is handed over)."""
        refs = {i: self.rollout.handle(i).stream_metrics.remote() for i in self.live()}
        out = {}
        for i, ref in refs.items():
            try:
                out[i] = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                self._died(i, err)
        return out

    def newly_dead(self) -> list[int]:
        """Workers that died since the last call (each named once)."""
        dead = sorted(self.rollout.dead_workers() - self._known_dead)
        self._known_dead.update(dead)
        for i in dead:
            self.in_flight.pop(i, None)
        return dead

    def all_in_flight(self, submitted) -> list[tuple[int, int | None]]:
        """(seq, start_version) of the groups the live workers reported, among `submitted` (not finished)."""
        return [x for i in self.live() for x in self.in_flight.get(i, []) if x[0] in submitted]

    def reset(self) -> int:
        """Cancel everything in flight on every live worker; the trajectories lost."""
        self.in_flight.clear()
        return sum(self.call(i, "stream_reset") for i in self.live())

    def _died(self, i: int, err: Exception) -> None:
        logger.error("rollout worker %d died: %s", i, err)
        self.rollout.mark_dead(i)  # raises when none is left
