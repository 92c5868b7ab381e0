"""The driver's retriever supervision against the real retrieval server (`python -m retrieval_server serve` over a
BM25 index, started by `RetrieverService` as in a run): a SIGKILLed server is restarted on the same port while a
step runs, its outage measured; a server that cannot come back, or an external `retriever.url` that stays down, ends
in a clear error in bounded time.

Run: .venv/bin/python -m pytest -q tests/trainer/test_trainer_supervisor.py
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time

import httpx
import pytest

from rsearch_verl.config import RetrieverConfig
from rsearch_verl.search.breaker import RetrieverDownError
from rsearch_verl.search.service import RetrieverError, RetrieverService, ensure_index, free_port
from rsearch_verl.search.supervisor import RetrieverSupervisor

logger = logging.getLogger(__name__)


def _cfg(**kw) -> RetrieverConfig:
    cfg = RetrieverConfig(encoder="bm25", index_type="flat", **{"start_timeout_s": 120.0, **kw})
    cfg.supervisor.check_interval_s, cfg.supervisor.backoff_s, cfg.supervisor.unhealthy_after = 0.2, 0.1, 2
    cfg.supervisor.max_restarts, cfg.breaker.deadline_s = 2, 60.0
    return cfg


@pytest.fixture(scope="module")
def corpus_index(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("supervised")
    corpus = root / "corpus.jsonl"
    docs = [("Hamlet", "Hamlet is a tragedy by William Shakespeare."), ("Paris", "Paris is the capital of France.")]
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"{t}"\n{x}'}) + "\n" for i, (t, x) in
                              enumerate(docs)))  # fmt: skip
    return str(corpus), ensure_index(_cfg(), str(corpus), str(root / "index"))


def _search_ok(url: str, timeout_s: float = 5.0) -> bool:
    try:
        resp = httpx.post(f"{url}/retrieve", json={"queries": ["hamlet"], "topk": 1}, timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200 and "Shakespeare" in resp.text


def test_killed_server_is_restarted_on_the_same_port_while_a_step_runs(corpus_index, tmp_path):
    corpus, index = corpus_index
    service = RetrieverService(_cfg(), corpus, index, log_path=str(tmp_path / "retriever.log"))
    with service as url:
        service.cfg.url = url  # as the training session does: the workers read the URL from the config
        sup = RetrieverSupervisor(service, service.cfg)
        assert _search_ok(url, timeout_s=120.0)  # the first search pays the server's lazy start-up (slow under load)
        first_pid = service.proc.pid
        with sup.watching():  # a step is running
            killed = time.monotonic()
            os.kill(first_pid, signal.SIGKILL)
            while not _search_ok(url):  # (each try: 5 s at most, so a slow first search is retried)
                assert time.monotonic() - killed < 120, "the server was not restarted"
                time.sleep(0.1)
            recovered_s = time.monotonic() - killed
        logger.info("SIGKILL -> searches answered again on the same port: %.1f s", recovered_s)
        assert service.proc.pid != first_pid and service.url == url
        metrics = sup.step_metrics()
        assert metrics["retriever/restarts"] == 1 and 0 < metrics["retriever/down_s"] <= recovered_s + 1
        assert sup.step_metrics() == {"retriever/restarts": 0.0, "retriever/down_s": 0.0}  # one window per step
        (outage,) = sup.take_outages()
        assert outage["recovered"] and outage["restarts"] == 1 and outage["down_s"] > 0
        sup.check()  # healthy: returns at once


def test_a_server_that_cannot_come_back_is_a_clear_error(corpus_index, tmp_path):
    corpus, index = corpus_index
    broken = str(tmp_path / "index")
    shutil.copytree(index, broken)
    service = RetrieverService(_cfg(), corpus, broken, log_path=str(tmp_path / "retriever.log"))
    with service:
        sup = RetrieverSupervisor(service, _cfg())
        shutil.rmtree(broken)  # every restart now fails: the index is gone
        os.kill(service.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RetrieverDownError, match=r"2 restart\(s\) failed.*retriever.log"):
            sup.check()
        assert time.monotonic() - start < 60
        assert sup.open_outage()["restarts"] == 2 and not sup.open_outage()["recovered"]


def test_external_retriever_dead_at_start_or_gone_mid_run(corpus_index, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RetrieverError, match=r"retriever.url=.* does not answer GET /health.*retrieval_server serve"):
        RetrieverService(_cfg(url=dead, start_timeout_s=1.0), None, None).__enter__()
    corpus, index = corpus_index
    own = RetrieverService(_cfg(), corpus, index, log_path=str(tmp_path / "retriever.log"))
    with own as url:
        cfg = _cfg(url=url)
        cfg.breaker.deadline_s = 2.0
        external = RetrieverService(cfg, None, None)
        assert external.__enter__() == url and not external.owned
        sup = RetrieverSupervisor(external, cfg)
        os.kill(own.proc.pid, signal.SIGKILL)  # the external server goes away; nobody may restart it
        start = time.monotonic()
        with pytest.raises(RetrieverDownError, match=rf"retriever.url={url} did not answer .* for 2 s"):
            sup.check()
        assert 2.0 <= time.monotonic() - start < 10
