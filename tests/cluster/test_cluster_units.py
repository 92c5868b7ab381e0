"""Pieces of multi-host support that need no cluster: where the run's own retriever listens
(rsearch_verl/search/service.py `serving_host`), publishing the driver's files into the run directory
(rsearch_verl/run_context.py), the gloo interface pin (rsearch_verl/workers/fsdp.py).

    .venv/bin/python -m pytest tests/cluster/test_cluster_units.py
"""

import os
import socket

from rsearch_verl.run_context import PUBLISHED, RunContext, publish
from rsearch_verl.search.service import serving_host
from rsearch_verl.workers.fsdp import pin_gloo_interface


def _routable_ip() -> str | None:
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def test_serving_host_is_loopback_only_for_a_local_ray():
    assert serving_host(None) == "127.0.0.1"
    assert serving_host("local") == "127.0.0.1"
    assert serving_host("127.0.0.1:6379") == "127.0.0.1"
    ip = _routable_ip()
    if ip:  # a cluster address: the local end of the route to the head (here: the head is this machine)
        assert serving_host(f"{ip}:6379") == ip
        assert serving_host(f"http://{ip}:8265") == ip


def test_publish_copies_into_the_run_dir_atomically_and_once(tmp_path):
    src = tmp_path / "cache" / "tokenizer_abc"
    src.mkdir(parents=True)
    (src / "tokenizer.json").write_text("{}")
    run_dir = tmp_path / "run"
    dst = publish(str(src), str(run_dir), "tokenizer_path")
    assert dst == str(run_dir / PUBLISHED / "tokenizer_path-tokenizer_abc")
    assert (run_dir / PUBLISHED / "tokenizer_path-tokenizer_abc" / "tokenizer.json").read_text() == "{}"
    (src / "tokenizer.json").write_text("changed")  # a second publish (a resumed run) reuses the copy
    assert publish(str(src), str(run_dir), "tokenizer_path") == dst
    assert publish(dst, str(run_dir), "tokenizer_path") == dst  # already in the run dir
    assert [n for n in os.listdir(run_dir / PUBLISHED) if n.startswith(".tmp")] == []
    ctx = RunContext(tokenizer_path=str(src), retriever_url="http://x:1").published(str(run_dir))
    assert ctx.tokenizer_path == dst and ctx.sft_checkpoint is None and ctx.retriever_url == "http://x:1"


def test_gloo_interface_follows_the_route_to_the_master(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    pin_gloo_interface("127.0.0.1")
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # one host over the loopback: gloo's own choice
    ip = _routable_ip()
    if ip:
        pin_gloo_interface(ip)
        import psutil

        name = os.environ["GLOO_SOCKET_IFNAME"]
        assert ip in [a.address for a in psutil.net_if_addrs()[name]]
