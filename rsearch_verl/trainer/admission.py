"""Which streamed groups a step trains on (trainer.rollout_mode=streaming, docs/async_training.md): the staleness
bound per sample, whole groups only, and a bounded bias towards short trajectories. Pure functions; the streaming
pipeline (rsearch_verl/trainer/stream_pipeline.py) carries the decisions out.

A group's *staleness* at step t is how many updates its oldest policy token is behind the weights step t trains
(version t-1): `(t - 1) - oldest_version`; `trainer.max_staleness` = k bounds it for every admitted sample.

Admitting whatever finishes first would favour short trajectories (they finish first, and long ones would age past
the bound and be dropped). So the admission is ordered by age instead:
  * a finished group whose staleness is over k is dropped (its prompt is generated again: counted);
  * a group still generating that started at version t-1-k is *due*: at step t+1 it would be over the bound, so step
    t waits for it (it is trained now) -- every trajectory the stream starts is trained within k+1 updates, however
    long it runs, and the short ones cannot crowd it out;
  * a group still generating that started before t-1-k can never be admitted (a rollback restored older weights):
    it is aborted and its prompt generated again (counted);
  * the batch is the `batch_size` finished groups that are due first, then oldest by submission.

    plan = admit(finished, in_flight, step=t, max_staleness=k, batch_size=B)
    if plan.ready: train on plan.admitted   # else poll the workers again (plan.waiting_for groups)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A finished group as the driver holds it."""

    seq: int  # submission order
    oldest_version: int  # the oldest policy version among its tokens
    turns: tuple[int, ...] = ()  # turns of each of its trajectories (for the bias metrics)


@dataclasses.dataclass(frozen=True)
class Plan:
    admitted: list[Candidate]  # trained this step (empty until `ready`)
    stale: list[Candidate]  # finished, over the bound: dropped, generated again
    abort: list[int]  # seqs generating that can never be admitted: cancelled, generated again
    waiting_for: int  # due groups still generating
    ready: bool


def staleness(step: int, version: int) -> int:
    return (step - 1) - version


def admit(finished: list[Candidate], in_flight: list[tuple[int, int | None]], step: int, max_staleness: int,
          batch_size: int) -> Plan:  # fmt: skip
    """The step's admission plan (module docstring). `in_flight`: (seq, start_version or None if not started)."""
    k = max_staleness
    stale = [c for c in finished if staleness(step, c.oldest_version) > k]
    fresh = [c for c in finished if staleness(step, c.oldest_version) <= k]
    started = [(seq, v) for seq, v in in_flight if v is not None]
    abort = [seq for seq, v in started if staleness(step, v) > k]
    due = [seq for seq, v in started if staleness(step, v) == k]
    # due first (they would be over the bound next step), then oldest submission
    order = sorted(fresh, key=lambda c: (staleness(step, c.oldest_version) < k, c.seq))
    admitted = order[:batch_size]
    ready = len(admitted) == batch_size and not due
    return Plan(admitted if ready else [], stale, abort, len(due), ready)
