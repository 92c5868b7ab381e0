"""Every metric run health reads is written (rsearch_verl/signals.py): the writers on the driver and
rollout side run here on a tiny batch, and each name the watchdog, the health record and the run control read must
come out of one of them. A writer renaming a metric without the reader fails this test (the workers' update metrics:
tests/workers/test_workers_fsdp.py and test_workers_mixed_precision.py)."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import numpy as np
import torch
from verl import DataProto

from rsearch_verl import signals as sig
from rsearch_verl.algos.losses import kl_loss, policy_loss, value_loss
from rsearch_verl.config import BreakerConfig, RetrieverConfig, RSearchConfig, WatchdogConfig
from rsearch_verl.rollout.agent_loop import CountingSearch, search_metrics
from rsearch_verl.search.breaker import CircuitBreaker
from rsearch_verl.search.supervisor import RetrieverSupervisor
from rsearch_verl.testing.batches import sequence_tensors
from rsearch_verl.trainer import phases
from rsearch_verl.trainer.health.report import COUNTED, RunHealth
from rsearch_verl.trainer.loop import Trainer
from rsearch_verl.trainer.run_control import RunControl
from rsearch_verl.trainer.stream_metrics import counted_metrics

WORKERS_ONLY = {sig.ACTOR_GRAD_NORM, sig.ACTOR_ENTROPY, sig.CRITIC_GRAD_NORM}  # written in the workers' update


def _batch() -> DataProto:
    b, p, r = 2, 2, 4
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])
    tensors = sequence_tensors(torch.ones(b, p, dtype=torch.long), torch.ones(b, r, dtype=torch.long),
                               torch.ones(b, p + r, dtype=torch.long), mask)  # fmt: skip
    tensors.update(
        rollout_versions=torch.zeros(b, r, dtype=torch.long),
        rollout_log_probs=-torch.ones(b, r),
        old_log_probs=-torch.ones(b, r),
    )
    non_tensors = {
        "n_searches": np.array([1, 0], dtype=object),
        "n_turns": np.array([2, 1], dtype=object),
        "finish_reason": np.array(["answer", "eos"], dtype=object),
        "search_failed": np.array([True, False], dtype=object),
        "uid": np.array(["a", "b"], dtype=object),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def _driver_metrics() -> dict[str, float]:
    batch, cfg = _batch(), RSearchConfig()
    metrics = {**phases.rollout_metrics(batch), **phases.logprob_check_phase(batch, 1)[1]}
    metrics.update(phases.failed_search_rows(batch, cfg)[1])
    batch.batch["loss_mask"] = torch.zeros_like(batch.batch["response_mask"])  # every row dropped: no update
    metrics.update(Trainer._update(SimpleNamespace(cfg=cfg), batch)[1])
    return metrics


def _loss_metrics() -> dict[str, float]:
    t = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    _, pg = policy_loss(old_log_prob=t, log_prob=t, advantages=t, response_mask=mask)
    _, kl = kl_loss(t, t, mask, kind="low_var_kl")
    _, vf = value_loss(values=t, old_values=t, returns=t, response_mask=mask)
    return {**pg, **kl, **vf}


def _search_metrics() -> dict[str, float]:
    async def search(queries, topk, source="local"):
        return [[] for _ in queries]

    breaker = CircuitBreaker(search, BreakerConfig())
    return search_metrics(search, CountingSearch(search), 0.1, breaker)


def _run_control_metrics() -> dict[str, float]:
    supervisor = RetrieverSupervisor(None, RetrieverConfig())
    control = RunControl(None, RunHealth(), WatchdogConfig(), supervisor)
    return dict(control.judge(1, {}).row)


def test_every_signal_run_health_reads_is_written():
    written = {**_driver_metrics(), **_loss_metrics(), **_search_metrics(), **_run_control_metrics()}
    written.update(counted_metrics(collections.Counter(lost=2)))  # the streaming pipeline's (trainer.rollout_mode)
    read = {sig.LOGPROB_GAP, sig.FINISH_ANSWER, sig.ENTROPY_MC, sig.RESPONSE_LEN, sig.ROLLBACKS}
    read |= {*set(sig.FINITE) - WORKERS_ONLY, *COUNTED, *sig.CARRIED_OVER_ROLLBACK}
    assert not read - written.keys(), f"read but never written: {sorted(read - written.keys())}"


def test_the_search_cost_summary_sums_what_the_client_writes():
    """summary.json's `search_cost` sums the search client's own cost metrics (written by a real SearchClient here)
    over every row, training steps and validations alike, and survives a checkpoint (a resumed run reports it all)."""
    import asyncio

    from rsearch_verl.search import SearchClient

    class Fake:
        name, batched, secret_env, where = "local", True, "", ""

        async def search(self, http, queries, topk, timeout_s):
            return [[] for _ in queries]

    client = SearchClient(RetrieverConfig(cache=False), {"local": Fake()}, coalesce=False)

    async def step(n: int) -> dict[str, float]:
        for _ in range(n):
            await client(["q"], 1)
        await client.aclose()
        return {**client.metrics(reset=True), **client.document_metrics(reset=True)}

    rows = [asyncio.run(step(n)) for n in (3, 2)]
    assert {sig.cost_s(kind) for kind in sig.COST_KINDS} <= rows[0].keys()
    assert sig.calls_of("search", "local") in rows[0] and sig.requests_of("search") in rows[0]
    health = RunHealth()
    for row in rows:
        health.add_step(row)
    again = RunHealth()
    again.load_state_dict(health.state_dict())
    cost = again.cost.summary()
    assert cost["search_calls"]["local"] == 5 and cost["requests"] == 5 and cost["documents_calls"]["local"] == 0
    assert cost["search_cost_s"] == round(sum(r["search/cost_s"] for r in rows), 3) and cost["documents_cost_s"] == 0
    assert set(cost["search_calls"]) == {"arxiv", "local", "news", "other", "web"}
    legacy = RunHealth()
    legacy.load_state_dict({k: v for k, v in health.state_dict().items() if k != "cost"})  # an older checkpoint
    assert legacy.cost.summary()["search_calls"] == {}
