"""Log-probs prefetched while a streaming step waits (rsearch_verl/trainer/prefetch.py): computed per finished group
over its own lengths and padded back, they land on the right rows and columns of the step's batch after concat,
`trim_padding` and the loop's fill; the proximal ones only when computed with the weights the step trains from; the
rows without them are computed by the step; `check` catches a wrong prefetched value.

The log-prob function here is a plain deterministic function of each row's ids and position (the merging is what is
tested; the real actor's calls run in tests/e2e/test_e2e_streaming.py with `trainer.prefetch_log_probs=check`).

Run: .venv/bin/python -m pytest -q tests/trainer/test_trainer_prefetch.py
"""

from __future__ import annotations

import pytest
import torch
from verl import DataProto

from rsearch_verl.batch import trim_padding
from rsearch_verl.testing.batches import sequence_tensors
from rsearch_verl.trainer.prefetch import PREFETCHED_OLD, PREFETCHED_REF, LogProbPrefetch, fill_log_probs

P, R = 6, 10  # the stream's fixed prompt and response widths


def group(seed: int, n: int = 2) -> DataProto:
    """`n` rows of random lengths, left-padded prompts and right-padded responses at the stream's widths."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = torch.zeros(n, P, dtype=torch.long), torch.zeros(n, R, dtype=torch.long)
    attn, rmask = torch.zeros(n, P + R, dtype=torch.long), torch.zeros(n, R, dtype=torch.long)
    for i in range(n):
        p, r = int(torch.randint(1, P + 1, (1,), generator=g)), int(torch.randint(1, R - 2, (1,), generator=g))
        prompts[i, P - p :] = torch.randint(5, 50, (p,), generator=g)
        responses[i, :r] = torch.randint(5, 50, (r,), generator=g)
        attn[i, P - p : P + r] = 1
        rmask[i, :r] = 1
    return DataProto.from_dict(tensors=sequence_tensors(prompts, responses, attn, rmask))


def fake_log_probs(key: str, shift: float = 0.0):
    """A deterministic stand-in for an actor call: depends on each row's response ids and the column only."""

    def compute(batch: DataProto) -> DataProto:
        resp = batch.batch["responses"].float()
        cols = torch.arange(resp.shape[1]).float()
        return DataProto.from_dict(tensors={key: -(resp * 0.01 + cols * 0.001 + shift)})

    return compute


def prefetch_compute(batch: DataProto, old: bool, ref: bool) -> DataProto:
    out = {}
    if old:
        out["old_log_probs"] = fake_log_probs("old_log_probs")(batch).batch["old_log_probs"]
    if ref:
        out["ref_log_prob"] = fake_log_probs("ref_log_prob", 1.0)(batch).batch["ref_log_prob"]
    return DataProto.from_dict(tensors=out)


def take(prefetch: LogProbPrefetch, groups: dict[int, DataProto], version: int) -> tuple[DataProto, dict]:
    metrics = prefetch.mark(list(groups.items()), version)
    batch = DataProto.concat(list(groups.values()))
    trim_padding(batch.batch)
    return batch, metrics


def test_prefetched_rows_equal_the_steps_own_and_stale_ones_are_recomputed():
    groups = {seq: group(seq) for seq in range(4)}
    prefetch = LogProbPrefetch(prefetch_compute, with_ref=True, world_size=1)
    assert prefetch.one(list(groups.items()), version=3)  # group 0 at version 3
    assert prefetch.one(list(groups.items()), version=3)  # group 1
    assert prefetch.one([(2, groups[2])], version=2)  # group 2 computed with an older actor: its ref still counts
    batch, metrics = take(prefetch, groups, version=3)
    assert metrics["stream/prefetched_old_frac"] == 0.5 and metrics["stream/prefetched_ref_frac"] == 0.75
    assert batch.batch[PREFETCHED_OLD].tolist() == [True] * 4 + [False] * 4
    assert batch.batch[PREFETCHED_REF].tolist() == [True] * 6 + [False] * 2

    calls = []

    def counted(key, shift=0.0):
        fn = fake_log_probs(key, shift)
        return lambda b: (calls.append(len(b)), fn(b))[1]

    batch, n_old = fill_log_probs(batch, "old_log_probs", PREFETCHED_OLD, counted("old_log_probs"), 1, check=False)
    batch, n_ref = fill_log_probs(batch, "ref_log_prob", PREFETCHED_REF, counted("ref_log_prob", 1.0), 1, check=False)
    assert (n_old, n_ref) == (4, 2) and calls == [4, 2]  # only the rows without them
    assert PREFETCHED_OLD not in list(batch.batch.keys()) and PREFETCHED_REF not in list(batch.batch.keys())
    whole = DataProto.concat([group(seq) for seq in range(4)])
    trim_padding(whole.batch)
    for key, shift in (("old_log_probs", 0.0), ("ref_log_prob", 1.0)):
        expected = fake_log_probs(key, shift)(whole).batch[key]
        mask = whole.batch["response_mask"].bool()  # the padding after a row's response is no token of it
        assert torch.equal(batch.batch[key][mask], expected[mask]), key  # same rows and columns as the step's own


def test_groups_are_computed_together_to_split_over_the_workers_and_check_raises_on_a_wrong_value():
    groups = {seq: group(seq, n=1) for seq in range(3)}
    prefetch = LogProbPrefetch(prefetch_compute, with_ref=False, world_size=2)
    assert prefetch.one(list(groups.items()), version=0)  # groups 0 and 1: two rows, one per worker
    assert not prefetch.one(list(groups.items()), version=0)  # group 2 alone would not split over two workers
    batch, metrics = take(prefetch, groups, version=0)
    assert PREFETCHED_REF not in list(batch.batch.keys())
    assert metrics["stream/prefetched_old_frac"] == pytest.approx(2 / 3)
    assert batch.batch[PREFETCHED_OLD].tolist() == [True, True, False]
    whole = DataProto.concat([group(seq, n=1) for seq in range(3)])
    trim_padding(whole.batch)
    expected, mask = fake_log_probs("old_log_probs")(whole).batch["old_log_probs"], whole.batch["response_mask"].bool()
    assert torch.equal(batch.batch["old_log_probs"][:2][mask[:2]], expected[:2][mask[:2]])  # split back row by row
    # one row missing does not split over 2 workers: every row is computed
    _, n = fill_log_probs(batch.select_idxs([0, 1, 2]), "old_log_probs", PREFETCHED_OLD,
                          fake_log_probs("old_log_probs"), 2, check=False)  # fmt: skip
    assert n == 3
    batch.batch["old_log_probs"][0, 0] += 0.5  # a prefetched value gone wrong
    with pytest.raises(RuntimeError, match="prefetched old_log_probs differ"):
        fill_log_probs(batch, "old_log_probs", PREFETCHED_OLD, fake_log_probs("old_log_probs"), 1, check=True)


def test_a_batch_that_was_not_streamed_is_computed_as_before():
    batch = group(7, n=3)
    out, n = fill_log_probs(batch, "old_log_probs", PREFETCHED_OLD, fake_log_probs("old_log_probs"), 1, check=False)
    assert n == 3 and torch.equal(
        out.batch["old_log_probs"], fake_log_probs("old_log_probs")(batch).batch["old_log_probs"]
    )
