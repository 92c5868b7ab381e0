"""HTTP API of the retrieval server against real `python -m retrieval_server serve` subprocesses.

Wire format with and without scores, Search-R1's own client request shape, defaults, /health, MiniLM and BM25
indexes, and the Search-R1-like baseline (rsearch_verl/testing/searchr1_server.py) answering exactly like the server.
"""

from __future__ import annotations

import httpx
import pytest
import requests


def _post(url: str, body: dict) -> dict:
    resp = httpx.post(f"{url}/retrieve", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _hit_rate(result: list, relevant: list[str], with_scores: bool) -> float:
    hits = 0
    for docs, rel in zip(result, relevant, strict=True):
        ids = [d["document"]["id"] if with_scores else d["id"] for d in docs]
        hits += rel in ids
    return hits / len(relevant)


@pytest.mark.parametrize("server_name", ["minilm_server", "bm25_server"])
def test_wire_format_with_scores(server_name, request, retrieval_corpus):
    server = request.getfixturevalue(server_name)
    pairs = retrieval_corpus[1][:8]
    out = _post(server.url, {"queries": [q for q, _ in pairs], "topk": 3, "return_scores": True})
    assert set(out) == {"result"}
    assert len(out["result"]) == len(pairs)
    for docs in out["result"]:
        assert len(docs) == 3
        for item in docs:
            assert set(item) == {"document", "score"}
            assert set(item["document"]) >= {"id", "contents"}
            assert isinstance(item["document"]["id"], str) and isinstance(item["document"]["contents"], str)
            assert isinstance(item["score"], float)
        scores = [item["score"] for item in docs]
        assert scores == sorted(scores, reverse=True)
    # The planted relevant passage is retrievable (index quality itself is tested by rs-index's tests).
    assert _hit_rate(out["result"], [rel for _, rel in pairs], with_scores=True) >= 0.75


@pytest.mark.parametrize("server_name", ["minilm_server", "bm25_server"])
def test_wire_format_without_scores(server_name, request, retrieval_corpus):
    server = request.getfixturevalue(server_name)
    pairs = retrieval_corpus[1][:4]
    out = _post(server.url, {"queries": [q for q, _ in pairs], "topk": 2, "return_scores": False})
    assert len(out["result"]) == len(pairs)
    for docs in out["result"]:
        assert len(docs) == 2
        for doc in docs:
            assert set(doc) >= {"id", "contents"} and "score" not in doc and "document" not in doc
    # Same documents as the scored call, same order.
    scored = _post(server.url, {"queries": [q for q, _ in pairs], "topk": 2, "return_scores": True})
    assert [[d["id"] for d in docs] for docs in out["result"]] == [
        [d["document"]["id"] for d in docs] for docs in scored["result"]
    ]


def test_search_r1_client_shape(minilm_server, retrieval_corpus):
    """Search-R1's generation code: `requests.post(url, json=payload).json()['result']`, then split title/text."""
    queries = [q for q, _ in retrieval_corpus[1][:3]]
    payload = {"queries": queries, "topk": 3, "return_scores": True}
    results = requests.post(f"{minilm_server.url}/retrieve", json=payload, timeout=60).json()["result"]
    assert len(results) == 3
    for retrieval_result in results:
        format_reference = ""
        for idx, doc_item in enumerate(retrieval_result):
            content = doc_item["document"]["contents"]
            title = content.split("\n")[0]
            text = "\n".join(content.split("\n")[1:])
            format_reference += f"Doc {idx + 1}(Title: {title}) {text}\n"
        assert format_reference.count("Doc ") == 3


def test_topk_defaults_and_missing_fields(minilm_server, retrieval_corpus):
    query = retrieval_corpus[1][0][0]
    # topk null / absent -> the server default (3, like Search-R1); return_scores absent -> false.
    for body in ({"queries": [query], "topk": None}, {"queries": [query]}):
        out = _post(minilm_server.url, body)
        assert len(out["result"][0]) == 3 and "id" in out["result"][0][0]
    assert len(_post(minilm_server.url, {"queries": [query], "topk": 7})["result"][0]) == 7
    # Unknown extra keys are ignored (clients of other Search-R1 versions send extras).
    assert _post(minilm_server.url, {"queries": [query], "topk": 1, "extra": 1})["result"][0]


@pytest.mark.parametrize("server_name", ["minilm_server", "bm25_server"])
def test_health(server_name, request):
    server = request.getfixturevalue(server_name)
    health = server.health()
    assert health["status"] == "ok"
    assert health["n_docs"] > 0 and isinstance(health["n_docs"], int)
    assert health["encoder"] and health["index_type"]
    assert health["mode"] == "batched" and health["auth"] is False
    assert health["batching"]["errors"] == 0


def test_searchr1_mode_matches_batched(minilm_server, searchr1_server, retrieval_corpus):
    queries = [q for q, _ in retrieval_corpus[1][:6]]
    body = {"queries": queries, "topk": 4, "return_scores": True}
    a = _post(minilm_server.url, body)["result"]
    b = _post(searchr1_server.url, body)["result"]
    assert [[d["document"]["id"] for d in docs] for docs in a] == [[d["document"]["id"] for d in docs] for docs in b]
    for da, db in zip(a, b, strict=True):
        assert [d["score"] for d in da] == pytest.approx([d["score"] for d in db], abs=1e-4)
    assert searchr1_server.health()["mode"] == "searchr1"


def test_search_r1_grpo_request_in_one_piece(bm25_server, retrieval_corpus):
    """Search-R1's GRPO step: 512 prompts x 5 rollouts = 2560 queries in ONE request, answered 200 whole, and the
    chunked search gives each query the same passages as a request of its own."""
    pairs = retrieval_corpus[1]
    queries = [pairs[i % len(pairs)][0] for i in range(2560)]
    out = _post(bm25_server.url, {"queries": queries, "topk": 3, "return_scores": True})
    assert len(out["result"]) == 2560 and all(len(docs) == 3 for docs in out["result"])
    alone = _post(bm25_server.url, {"queries": queries[:5], "topk": 3, "return_scores": True})["result"]
    ids = [[d["document"]["id"] for d in docs] for docs in out["result"]]
    assert ids[:5] == [[d["document"]["id"] for d in docs] for docs in alone]
    assert ids[len(pairs) : len(pairs) + 5] == ids[:5]  # the same query in a later chunk
    assert bm25_server.health()["limits"]["max_queries"] >= 4096
