"""Hostile and malformed input against real server subprocesses: always a 4xx with {"detail": str}, never a 500,
and the server answers a normal query afterwards. Covers the server and the Search-R1-like baseline, auth, and every
limit.
"""

from __future__ import annotations

import socket

import httpx
import pytest

HEADERS = {"content-type": "application/json"}

BAD_BODIES = {
    "malformed_json": b'{"queries": ["a"',
    "not_utf8": b"\xff\xfe\xfa",
    "empty_body": b"",
    "json_array": b'["who"]',
    "json_string": b'"who"',
    "missing_queries": b'{"topk": 3}',
    "queries_string": b'{"queries": "who is it"}',
    "queries_null": b'{"queries": null}',
    "queries_int_items": b'{"queries": [1, 2]}',
    "queries_nested": b'{"queries": [["a"]]}',
    "empty_list": b'{"queries": []}',
    "empty_string": b'{"queries": [""]}',
    "blank_string": b'{"queries": ["   "]}',
    "topk_zero": b'{"queries": ["a"], "topk": 0}',
    "topk_negative": b'{"queries": ["a"], "topk": -3}',
    "topk_huge": b'{"queries": ["a"], "topk": 1000000000000}',
    "topk_bignum": b'{"queries": ["a"], "topk": 123456789012345678901234567890}',
    "topk_string": b'{"queries": ["a"], "topk": "3"}',
    "topk_float": b'{"queries": ["a"], "topk": 2.5}',
    "topk_bool": b'{"queries": ["a"], "topk": true}',
    "topk_list": b'{"queries": ["a"], "topk": [3]}',
    "return_scores_string": b'{"queries": ["a"], "return_scores": "yes"}',
    "query_100kb": b'{"queries": ["' + b"x" * 100_000 + b'"]}',
    "too_many_queries": b'{"queries": [' + b",".join([b'"q"'] * 4100) + b"]}",  # > the 4096 default
}


def _assert_4xx(resp: httpx.Response, *codes: int) -> None:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    if codes:
        assert resp.status_code in codes, (resp.status_code, resp.text[:300])
    detail = resp.json()["detail"]
    assert isinstance(detail, str) and detail


def _assert_still_serving(url: str, headers: dict | None = None) -> None:
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    resp = httpx.post(f"{url}/retrieve", json={"queries": ["capital city"], "topk": 2}, headers=headers, timeout=60)
    assert resp.status_code == 200 and len(resp.json()["result"][0]) == 2


@pytest.mark.parametrize("server_name", ["minilm_server", "searchr1_server"])
def test_bad_bodies_are_4xx(server_name, request):
    server = request.getfixturevalue(server_name)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for name, body in BAD_BODIES.items():
            resp = client.post("/retrieve", content=body, headers=HEADERS)
            try:
                _assert_4xx(resp)
            except AssertionError as exc:
                raise AssertionError(f"case {name}: {exc}") from None
    _assert_still_serving(server.url)
    if server_name == "minilm_server":
        assert server.health()["batching"]["errors"] == 0


def test_limit_codes_batched(minilm_server):
    """The fast path names each problem with the right code: 400 bad JSON, 422 bad fields, 413 big body."""
    with httpx.Client(base_url=minilm_server.url, timeout=60) as client:
        _assert_4xx(client.post("/retrieve", content=BAD_BODIES["malformed_json"], headers=HEADERS), 400)
        for name in ("empty_list", "empty_string", "topk_zero", "topk_huge", "topk_negative", "query_100kb"):
            _assert_4xx(client.post("/retrieve", content=BAD_BODIES[name], headers=HEADERS), 422)
        big = b'{"queries": ["' + b"y" * (9 << 20) + b'"]}'  # 9 MiB > the 8 MiB default body limit
        _assert_4xx(client.post("/retrieve", content=big, headers=HEADERS), 413)
    _assert_still_serving(minilm_server.url)


def test_chunked_body_over_limit_is_refused(minilm_server):
    """No Content-Length (chunked upload): the bytes are counted as they arrive."""

    def chunks():
        yield b'{"queries": ["'
        for _ in range(140):  # 8.75 MiB > the 8 MiB default, sent without a Content-Length
            yield b"z" * 65536
        yield b'"]}'

    resp = httpx.post(f"{minilm_server.url}/retrieve", content=chunks(), headers=HEADERS, timeout=60)
    _assert_4xx(resp, 413)
    _assert_still_serving(minilm_server.url)


def test_unknown_route_and_method(minilm_server):
    with httpx.Client(base_url=minilm_server.url, timeout=30) as client:
        _assert_4xx(client.get("/nope"), 404)
        _assert_4xx(client.post("/retrieve/../admin", json={}), 404)
        _assert_4xx(client.get("/retrieve"), 405)
        _assert_4xx(client.delete("/health"), 405)
    _assert_still_serving(minilm_server.url)


def test_garbage_bytes_on_the_socket(minilm_server):
    host, port = minilm_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"\x00\x01NOT HTTP AT ALL\r\n\r\n")
        reply = sock.recv(1024)
    assert reply == b"" or reply.startswith(b"HTTP/1.1 4")
    _assert_still_serving(minilm_server.url)


def test_bearer_token(token_server):
    url = f"{token_server.url}/retrieve"
    body = {"queries": ["capital city"], "topk": 2}
    _assert_4xx(httpx.post(url, json=body, timeout=30), 401)
    _assert_4xx(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}, timeout=30), 401)
    _assert_4xx(httpx.post(url, json=body, headers={"Authorization": "test-token"}, timeout=30), 401)
    _assert_4xx(httpx.post(url, content=b"{bad", headers={**HEADERS}, timeout=30), 401)  # auth before parsing
    good = {"Authorization": "Bearer test-token"}
    assert httpx.post(url, json=body, headers=good, timeout=30).status_code == 200
    # Limits from the command line: --max-queries 8 --max-topk 20.
    _assert_4xx(httpx.post(url, json={"queries": ["q"] * 9}, headers=good, timeout=30), 422)
    _assert_4xx(httpx.post(url, json={"queries": ["q"], "topk": 21}, headers=good, timeout=30), 422)
    health = token_server.health()  # health stays open for liveness probes; it reveals no documents
    assert health["auth"] is True and health["limits"]["max_topk"] == 20
    _assert_still_serving(token_server.url, headers=good)


def test_binds_loopback_only(minilm_server):
    """Default bind is 127.0.0.1: the port is not reachable on the machine's other addresses."""
    port = int(minilm_server.url.rsplit(":", 1)[1])
    try:
        other = socket.gethostbyname(socket.gethostname())
    except OSError:
        pytest.skip("no resolvable host address")
    if other.startswith("127."):
        pytest.skip("host name resolves to loopback only")
    with pytest.raises(OSError), socket.create_connection((other, port), timeout=2):
        pass
