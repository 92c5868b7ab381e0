"""The preflight (seconds, before the warm start and the workers) and the secrets that reach Ray workers.

A dead retriever.url is reported after a few bounded probes, naming the key; an unwritable trainer.run_dir names its
key; `worker_secrets` picks the set secret variables (the judge's too) and `init_ray` puts them into the local runtime
env, or into ray.init's when a driver joins a cluster by hand, never beside a submitted job's runtime env.
Run: .venv/bin/python -m pytest -q tests/trainer/test_preflight.py
"""

import logging
import socket
import time

import pytest

from rsearch_verl.config import WatchdogConfig, load_config
from rsearch_verl.secrets import worker_secrets
from rsearch_verl.trainer import session
from rsearch_verl.trainer.health import RunStopped
from rsearch_verl.trainer.preflight import PreflightError, check_run_dir, preflight, wait_for_retriever


def _dead_url() -> str:
    with socket.socket() as sock:  # a port nothing listens on once the socket is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_dead_retriever_url_fails_fast_naming_the_key(caplog, tmp_path):
    url = _dead_url()
    cfg = load_config(["+recipe=search_r1_ppo", f"retriever.url={url}", "retriever.preflight_wait_s=2"])
    start = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(PreflightError) as info:
        preflight(cfg, str(tmp_path / "run"))
    took = time.monotonic() - start
    assert isinstance(info.value, RunStopped)  # exit code 3 from python -m rsearch_verl.main
    assert f"retriever.url={url}" in str(info.value) and "retriever.preflight_wait_s" in str(info.value)
    assert 1.5 < took < 10, took
    assert "waiting for retriever.url" in caplog.text  # the wait says what it waits for


def test_zero_wait_probes_once():
    with pytest.raises(PreflightError, match=r"after 1 probe\(s\)"):
        wait_for_retriever(_dead_url(), 0)


def test_unwritable_run_dir_names_the_key(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(PreflightError, match=r"trainer\.run_dir=.*a_file/run is not writable"):
        check_run_dir(str(blocker / "run"))
    check_run_dir(str(tmp_path / "ok"))
    assert list((tmp_path / "ok").iterdir()) == []  # the probe file is gone


def test_worker_secrets_only_the_set_ones():
    cfg = load_config(["+recipe=search_r1_ppo", "reward.judge.api_key_env=MY_JUDGE_KEY"])
    environ = {"RETRIEVER_TOKEN": "t", "SERPER_API_KEY": "", "MY_JUDGE_KEY": "j", "WANDB_API_KEY": "w", "PATH": "/bin"}
    assert worker_secrets(cfg, environ) == {"RETRIEVER_TOKEN": "t", "MY_JUDGE_KEY": "j", "WANDB_API_KEY": "w"}
    assert worker_secrets(None, {"OPENAI_API_KEY": "o"}) == {}


@pytest.fixture
def captured_init(monkeypatch):
    import ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setenv("RETRIEVER_TOKEN", "secret-token-value")
    for var in ("RAY_ADDRESS", "RAY_JOB_CONFIG_JSON_ENV_VAR", "SERPER_API_KEY", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    return calls


def test_init_ray_forwards_secrets_locally(captured_init, caplog):
    cfg = load_config(["+recipe=search_r1_ppo"])
    with caplog.at_level(logging.INFO):
        session.init_ray(cfg)
    env_vars = captured_init[0]["runtime_env"]["env_vars"]
    assert env_vars["RETRIEVER_TOKEN"] == "secret-token-value" and env_vars["TOKENIZERS_PARALLELISM"] == "false"
    assert "RETRIEVER_TOKEN" in caplog.text and "secret-token-value" not in caplog.text


def test_init_ray_on_a_cluster(captured_init, monkeypatch):
    cfg = load_config(["+recipe=search_r1_ppo"])
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    session.init_ray(cfg)  # a driver started by hand: no job runtime env, so it passes the secrets itself
    assert captured_init[-1]["runtime_env"] == {"env_vars": {"RETRIEVER_TOKEN": "secret-token-value"}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    session.init_ray(cfg)  # inside `ray job submit`: the job's runtime env (submit.sh put the secrets there)
    assert captured_init[-1]["runtime_env"] is None


def test_an_auth_error_from_a_rollout_worker_stops_the_run():
    """A SearchAuthError raised in a Ray worker (wrapped in a RayTaskError) becomes a Stop naming the variable."""
    from types import SimpleNamespace

    import ray

    from rsearch_verl.search import SearchAuthError
    from rsearch_verl.trainer.run_control import RunControl

    stops = []
    health = SimpleNamespace(stop=None, record_stop=lambda *a: stops.append(a))
    control = RunControl(ckpts=None, health=health, watchdog=WatchdogConfig())
    control.done_step = 4
    cause = SearchAuthError("RETRIEVER_TOKEN", "retriever.url=http://x answered HTTP 401 (...): RETRIEVER_TOKEN ...")
    wrapped = ray.exceptions.RayTaskError("generate_sequences", "Traceback ...", cause)
    stop = control.stopped(wrapped)
    assert "during step 5" in stop.message and "RETRIEVER_TOKEN" in stop.message and stop.save_step is None
    assert stops == [(5, str(cause))]


def test_missing_web_key_is_a_warning(caplog, monkeypatch, tmp_path):
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    cfg = load_config(["+recipe=r_search_dag_grpo"])
    with caplog.at_level(logging.WARNING):
        preflight(cfg, str(tmp_path))
    assert "SERPER_API_KEY is not set: the news/web search tools" in caplog.text


def test_waiting_for_the_retrieval_server_names_the_key(monkeypatch, caplog):
    from rsearch_verl.search import service as retriever_service

    monkeypatch.setattr(retriever_service, "PROGRESS_EVERY_S", 0.2)
    with caplog.at_level(logging.INFO), pytest.raises(retriever_service.RetrieverError, match="not healthy after"):
        retriever_service.wait_healthy("http://127.0.0.1:9", timeout_s=1.0)
    assert "retriever.start_timeout_s=1" in caplog.text
