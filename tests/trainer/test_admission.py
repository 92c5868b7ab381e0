"""The streaming admission (rsearch_verl/trainer/admission.py): the staleness bound per sample, whole groups, the
due groups waited for and trained first, hopeless ones aborted.

Run: .venv/bin/python -m pytest -q tests/trainer/test_admission.py
"""

from __future__ import annotations

import random

from rsearch_verl.trainer.admission import Candidate, admit_bounded, staleness


def test_staleness_counts_updates_behind_the_trained_weights():
    assert staleness(step=5, version=4) == 0  # step 5 trains version 4
    assert staleness(step=5, version=2) == 2


def test_over_the_bound_is_dropped_never_admitted():
    finished = [Candidate(0, oldest_version=1), Candidate(1, oldest_version=3), Candidate(2, oldest_version=4)]
    plan = admit_bounded(finished, [], step=5, max_staleness=1, batch_size=2)
    assert plan.ready and [c.seq for c in plan.admitted] == [1, 2]
    assert [c.seq for c in plan.stale] == [0]


def test_a_due_group_is_waited_for_then_trained_first():
    # step 5, k=1: a group that started with version 3 is due (staleness 1 now, 2 at step 6)
    finished = [Candidate(5, 4), Candidate(6, 4), Candidate(7, 4)]
    plan = admit_bounded(finished, [(2, 3), (8, 4), (9, None)], step=5, max_staleness=1, batch_size=2)
    assert not plan.ready and plan.admitted == [] and plan.waiting_for == 1
    # it finished: it goes in first although later groups finished before it
    plan = admit_bounded([*finished, Candidate(2, 3)], [(8, 4), (9, None)], step=5, max_staleness=1, batch_size=2)
    assert plan.ready and [c.seq for c in plan.admitted] == [2, 5]
    assert plan.waiting_for == 0 and plan.abort == [] and plan.stale == []


def test_groups_that_can_never_be_admitted_are_aborted():
    plan = admit_bounded([Candidate(3, 4)], [(1, 2), (2, 3)], step=5, max_staleness=1, batch_size=1)
    assert plan.abort == [1] and plan.waiting_for == 1 and not plan.ready


def test_random_plans_keep_every_admitted_sample_within_the_bound():
    rng = random.Random(0)
    for _ in range(500):
        step, k, b = rng.randint(1, 20), rng.randint(1, 3), rng.randint(1, 6)
        finished = [Candidate(s, rng.randint(max(0, step - 6), step - 1)) for s in range(rng.randint(0, 12))]
        in_flight = [(100 + i, rng.choice([None, rng.randint(max(0, step - 6), step - 1)])) for i in range(4)]
        plan = admit_bounded(finished, in_flight, step, k, b)
        assert all(staleness(step, c.oldest_version) <= k for c in plan.admitted)
        assert all(staleness(step, c.oldest_version) > k for c in plan.stale)
        assert len(plan.admitted) in (0, b) and (len(plan.admitted) == b) == plan.ready
        seqs = [c.seq for c in plan.admitted]
        assert len(set(seqs)) == len(seqs)
        if plan.ready:  # nothing due is left behind while a less urgent group is trained
            due = [c for c in finished if staleness(step, c.oldest_version) == k]
            assert all(c in plan.admitted for c in due) or len(due) > b
