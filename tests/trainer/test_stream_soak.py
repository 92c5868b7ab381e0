"""The real StreamingPipeline (rsearch_verl/trainer/stream_pipeline.py) driven for hundreds of steps by scripted
rollout workers (rsearch_verl/testing/scripted_stream.py: real Ray actors, heavy-tailed group times, folded rows of
different widths, failed groups), one of them killed midway:

* every drawn prompt is trained exactly once, or counted lost and generated again; none is skipped (checked against
  the loader's own uids up to the pipeline's resume point) and none trained twice;
* every step's batch joins groups of different widths (`join_rows`); no stall; the pipeline's state stays bounded;
* `admission`: the capacity rule holds (never more than (k+1) x B groups started and not trained) and a long group is
  trained late rather than dropped; `oldest_token`: every admitted group within the bound, long ones waited for.

Run: .venv/bin/python -m pytest -q tests/trainer/test_stream_soak.py
"""

from __future__ import annotations

import collections
import contextlib
import re
import resource
import time

import numpy as np
import pytest
import ray
from verl import DataProto

from rsearch_verl.config import load_config
from rsearch_verl.data.dataset import PromptLoader
from rsearch_verl.testing.scripted_stream import ScriptedStreamWorker
from rsearch_verl.trainer.stream_pipeline import StreamingPipeline
from rsearch_verl.workers.generation_group import GenerationGroup

B, N, K = 2, 2, 1


class _Prompts:
    """A dataset of 40 prompts of different lengths (the loader's interface: len, to_batch)."""

    def __len__(self) -> int:
        return 40

    def to_batch(self, indices: list[int], uids: list[str]) -> DataProto:
        def col(values):
            arr = np.empty(len(values), dtype=object)
            arr[:] = values
            return arr

        return DataProto.from_dict(
            non_tensors={"uid": col(uids), "prompt_ids": col([[3] * (4 + i % 9) for i in indices])}
        )


class _Group:
    def __init__(self, workers):
        self.workers = workers


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False)
    yield
    ray.shutdown()


def _pipeline(rule: str, n_workers: int):
    cfg = load_config(["trainer.placement=split", f"trainer.max_staleness={K}", "trainer.rollout_mode=streaming",
                       f"trainer.staleness_rule={rule}", f"data.train_batch_size={B}", f"rollout.n={N}",
                       "rollout.max_concurrent_trajectories=4"])  # fmt: skip
    actor = ray.remote(num_cpus=0)(ScriptedStreamWorker)
    handles = [actor.remote(n=N, pool=4, seed=i) for i in range(n_workers)]
    group = GenerationGroup(_Group(handles), n_workers, cfg)
    loader = PromptLoader(_Prompts(), B, seed=0)
    return StreamingPipeline(group, loader, cfg, seed_for=lambda d: d), handles, loader


def _drawn_before(state: dict) -> set[str]:
    """Every uid the loader hands out before `state` (epoch, pos), in its own naming (e{epoch}-p{pos})."""
    per_epoch = (40 // B) * B
    return {f"e{e}-p{p}" for e in range(state["epoch"] + 1) for p in range(per_epoch)
            if (e, p) < (state["epoch"], state["pos"])}  # fmt: skip


def _run(pipeline, handles, steps: int, kill_at: int | None = None):
    trained, widths, metrics, rss = collections.Counter(), set(), [], []
    for step in range(1, steps + 1):
        if step == kill_at:
            ray.kill(handles[0], no_restart=True)
        batch = pipeline.take(step)
        uids = {str(u) for u in batch.non_tensor_batch["uid"]}
        assert len(uids) == B and len(batch) >= B * N  # whole groups; folded trajectories are several rows
        assert batch.batch["input_ids"].shape[1] == batch.batch["prompts"].shape[1] + batch.batch["responses"].shape[1]
        widths.add(tuple(batch.batch["input_ids"].shape[1:]))
        trained.update(uids)
        metrics.append(batch.meta_info["metrics"])
        for i, h in enumerate(handles):  # the update's weights land on every live worker
            if i not in pipeline.workers.rollout.dead_workers():
                with contextlib.suppress(ray.exceptions.RayActorError):
                    ray.get(h.set_version.remote(step))
        pipeline.applied()
        # bounded by the draws a long group keeps open while it generates, not by the run's history
        assert pipeline.ledger.open_draws() <= 40
        assert len(pipeline.feed.out) + len(pipeline._done) <= (K + 1) * B
        rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return trained, widths, metrics, rss


def _check_exactly_once(pipeline, trained: collections.Counter) -> None:
    assert max(trained.values()) == 1, [u for u, c in trained.items() if c > 1]  # none twice
    state = pipeline.resume_state()
    expected = _drawn_before(state) | set(state.get("trained_uids", []))
    assert set(trained) == expected, (sorted(expected - set(trained))[:5], sorted(set(trained) - expected)[:5])
    assert all(re.fullmatch(r"e\d+-p\d+", u) for u in trained)


@pytest.mark.timeout(600)
def test_admission_soak_two_workers_one_killed(local_ray):
    pipeline, handles, _ = _pipeline("admission", n_workers=2)
    start = time.monotonic()
    trained, widths, metrics, rss = _run(pipeline, handles, steps=200, kill_at=100)
    assert time.monotonic() - start < 400  # no stall
    _check_exactly_once(pipeline, trained)
    assert len(trained) == 200 * B
    assert len(widths) > 10  # groups of different widths were joined
    lost = sum(m["stream/lost_trajectories"] for m in metrics)
    assert lost > 0 and sum(m["stream/rollout_workers_lost"] for m in metrics) == 1
    assert sum(m["stream/dropped_stale"] + m["stream/aborted"] for m in metrics) == 0  # nothing dropped for age
    assert max(m["stream/lag_head_max"] for m in metrics) > K  # a long group trained late, not dropped
    assert all(m["stream/lag_tail_max"] <= m["stream/lag_head_max"] for m in metrics)
    assert any(m["stream/multi_version_rows_frac"] > 0 for m in metrics)  # partial rollouts across updates
    assert rss[-1] - rss[len(rss) // 4] < 200_000  # KiB: flat (Ray's client buffers aside)


@pytest.mark.timeout(600)
def test_oldest_token_keeps_every_group_in_the_bound(local_ray):
    pipeline, handles, _ = _pipeline("oldest_token", n_workers=2)
    trained, _, metrics, _ = _run(pipeline, handles, steps=60)
    _check_exactly_once(pipeline, trained)
    assert all(m["stream/lag_head_max"] <= K for m in metrics)
    assert any(m["stream/wait_s"] > 0.1 for m in metrics)  # steps waited for due long groups
