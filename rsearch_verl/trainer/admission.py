"""Which streamed groups may start and which a step trains (trainer.rollout_mode=streaming, docs/async_training.md).
Pure functions; the streaming pipeline (rsearch_verl/trainer/stream_pipeline.py) carries the decisions out.

A group's *lag* at step t is how many updates one of its policy tokens is behind the weights step t trains (version
t-1): `staleness(t, version) = (t - 1) - version`. Its head lag is its oldest token's, its tail lag its newest's.
`trainer.max_staleness` = k, `data.train_batch_size` = B. Two rules (`trainer.staleness_rule`):

  admission (the default; AReaL's and SkyRL's capacity rule, verl's fully-async rollouter bounds the same way):
    staleness is bounded where a group *starts*. A group may start only while the groups started and not yet trained
    fit in (k + 1) x B (`room_to_start`), so a group starts at most k updates ahead of the weights it is trained
    with, counted in batches. A step trains the B finished whole groups with the oldest tokens (`admit_oldest`) and
    never waits for a particular group still generating; nothing is dropped for age. A group that generates for
    longer than k updates is trained more than k updates late (its head lag is reported, `stream/lag_head_max`); the
    off-policy correction weights its tokens by the recorded behaviour log-probs (algos/off_policy.py).
  oldest_token (the strict option, as ROLL aborts by age): every admitted group's oldest token is at most k updates
    behind (`admit_bounded`):
      * a finished group whose staleness is over k is dropped (its prompt is generated again: counted);
      * a group still generating that started at version t-1-k is *due*: at step t+1 it would be over the bound, so
        step t waits for it -- every trajectory is trained within k+1 updates, however long it runs, and a step waits
        for the longest one of its due groups;
      * a group still generating that started before t-1-k can never be admitted: it is aborted and generated again;
      * the batch is the B finished groups that are due first, then oldest by submission.

    room = room_to_start(outstanding_groups, max_staleness=k, batch_size=B)
    plan = admit(rule, finished, in_flight, step=t, max_staleness=k, batch_size=B)
    if plan.ready: train on plan.admitted   # else poll the workers again (plan.waiting_for groups)
"""

from __future__ import annotations

import dataclasses

RULES = ("admission", "oldest_token")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A finished group as the driver holds it."""

    seq: int  # submission order
    oldest_version: int  # the oldest policy version among its tokens
    turns: tuple[int, ...] = ()  # turns of each of its trajectories (for the bias metrics)
    newest_version: int | None = None  # the newest policy version among its tokens (None: the oldest)

    @property
    def newest(self) -> int:
        return self.oldest_version if self.newest_version is None else self.newest_version


@dataclasses.dataclass(frozen=True)
class Plan:
    admitted: list[Candidate]  # trained this step (empty until `ready`)
    stale: list[Candidate]  # finished, over the bound: dropped, generated again (oldest_token only)
    abort: list[int]  # seqs generating that can never be admitted: cancelled, generated again (oldest_token only)
    waiting_for: int  # due groups still generating (oldest_token only)
    ready: bool


def staleness(step: int, version: int) -> int:
    return (step - 1) - version


def room_to_start(outstanding: int, max_staleness: int, batch_size: int) -> int:
    """How many groups may start now: `outstanding` groups are started (submitted) and not yet trained; at most
    (k + 1) x B may be, so that none starts more than k updates (of B groups) ahead of its update."""
    return max(0, (max_staleness + 1) * batch_size - outstanding)


def admit(rule: str, finished: list[Candidate], in_flight: list[tuple[int, int | None]], step: int,
          max_staleness: int, batch_size: int) -> Plan:  # fmt: skip
    """The step's plan under `rule` (module docstring). `in_flight`: (seq, start_version or None if not started)."""
    if rule == "admission":
        return admit_oldest(finished, batch_size)
    if rule == "oldest_token":
        return admit_bounded(finished, in_flight, step, max_staleness, batch_size)
    raise ValueError(f"trainer.staleness_rule: {rule!r} is not one of {list(RULES)}")


def admit_oldest(finished: list[Candidate], batch_size: int) -> Plan:
    """The admission rule's step: the B finished groups with the oldest tokens (then by submission), once B are
    finished; none dropped, none waited for."""
    order = sorted(finished, key=lambda c: (c.oldest_version, c.seq))
    ready = len(order) >= batch_size
    return Plan(order[:batch_size] if ready else [], [], [], 0, ready)


def admit_bounded(finished: list[Candidate], in_flight: list[tuple[int, int | None]], step: int, max_staleness: int,
                  batch_size: int) -> Plan:  # fmt: skip
    """The oldest_token rule's step (module docstring)."""
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
