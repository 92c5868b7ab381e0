"""Long documents: `build --chunk-tokens N` passages that know their document, `doc_id` in /retrieve, POST /documents
pages, its 4xx answers, and `--chunk-tokens 0` building exactly what it did before chunking existed.

Indexes are built through the real CLI and served by real `python -m retrieval_server serve` subprocesses
(tests/retrieval/conftest.py: `chunked_server`, `unchunked_server`, the corpus of `make_documents_corpus`).
Run: .venv/bin/python -m pytest -q tests/retrieval/test_retrieval_documents.py
"""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest
from conftest import CHUNK_TOKENS, DOCS_TOKEN, PAGE_TOKENS, PLANTED

from retrieval_server.build import build_index
from retrieval_server.corpus import CorpusStore
from retrieval_server.documents import PageOutOfRange, chunk_document, paginate, split_title

AUTH = {"authorization": f"Bearer {DOCS_TOKEN}"}


def _documents(url: str, body, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(f"{url}/documents", content=content, headers=headers, timeout=60)


def _pages(url: str, doc_id: str, headers: dict | None = None) -> list[dict]:
    """Every page of `doc_id`, page 0 first (its `pages` says how many to fetch)."""
    first = _documents(url, {"ids": [doc_id]}, headers)
    assert first.status_code == 200, first.text
    out = first.json()["result"]
    for page in range(1, out[0]["pages"]):
        resp = _documents(url, {"ids": [doc_id], "page": page}, headers)
        assert resp.status_code == 200, resp.text
        out += resp.json()["result"]
    return out


# ---- chunking and paging, as functions -----------------------------------------------------------------------------
def test_chunk_document_balances_parts_and_keeps_the_title():
    body = " ".join(f"w{i}" for i in range(257))
    parts = chunk_document({"id": "d", "contents": f'"T"\n{body}'}, 128)
    assert [p["id"] for p in parts] == ["d#0", "d#1", "d#2"]  # ceil(257 / 128) parts of 85-86 words, no tiny tail
    assert [len(p["contents"].split("\n", 1)[1].split()) for p in parts] == [85, 86, 86]
    assert all(p["contents"].startswith('"T"\n') and p["doc_id"] == "d" for p in parts)
    assert chunk_document({"id": "e", "contents": '"Only a title"\n'}, 10) == [
        {"id": "e#0", "contents": '"Only a title"\n', "doc_id": "e"}
    ]


def test_paginate_reassembles_exactly_and_refuses_past_the_end():
    contents = '"T"\n  lead space\n\ntwo  words and more words here\n'
    pages = [paginate(contents, p, 3) for p in range(3)]
    assert {n for _, n in pages} == {3}
    assert "".join(split_title(c)[1] for c, _ in pages) == split_title(contents)[1]
    with pytest.raises(PageOutOfRange) as exc:
        paginate(contents, 3, 3)
    assert exc.value.pages == 3
    assert paginate('"Empty"\n', 0, 5) == ('"Empty"\n', 1)
    assert paginate("no title line at all", 0, 2) == ("no title ", 3)  # 5 words, no title: all text


# ---- the chunked index ----------------------------------------------------------------------------------------------
def test_passages_know_their_document(chunked_index, documents_corpus):
    docs = documents_corpus[1]
    store = CorpusStore.open(str(chunked_index / "corpus"))
    passages = store.get(list(range(len(store))))
    manifest = json.loads((chunked_index / "manifest.json").read_text())
    assert manifest["chunk_tokens"] == CHUNK_TOKENS and manifest["n_docs"] == len(passages)
    for doc_id, contents in docs.items():
        mine = [p for p in passages if p["doc_id"] == doc_id]
        head, body = split_title(contents)
        assert [p["id"] for p in mine] == [
            f"{doc_id}#{k}" for k in range(max(1, math.ceil(len(body.split()) / CHUNK_TOKENS)))
        ]
        assert all(p["contents"].startswith(head) for p in mine)
        texts = [split_title(p["contents"])[1] for p in mine]
        assert all(len(t.split()) <= CHUNK_TOKENS for t in texts)
        assert " ".join(texts).split() == body.split()  # every word once, in order
    assert len(passages) == sum(len([p for p in passages if p["doc_id"] == d]) for d in docs)


@pytest.mark.parametrize("with_scores", [True, False])
def test_retrieve_carries_the_document_id(chunked_server, with_scores):
    queries = [phrase for _, _, phrase in PLANTED]
    body = {"queries": queries, "topk": 2, "return_scores": with_scores}
    resp = httpx.post(f"{chunked_server.url}/retrieve", json=body, headers=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    for (doc_id, _, phrase), hits in zip(PLANTED, resp.json()["result"], strict=True):
        if with_scores:
            assert all(set(h) == {"document", "score"} for h in hits)
            hits = [h["document"] for h in hits]
        assert all(set(h) == {"id", "contents", "doc_id"} for h in hits)  # Search-R1's shape plus doc_id
        top = hits[0]
        assert top["doc_id"] == doc_id and top["id"].startswith(f"{doc_id}#") and phrase in top["contents"]


def test_documents_pages_reassemble_each_document(chunked_server, documents_corpus):
    for doc_id, contents in documents_corpus[1].items():
        head, body = split_title(contents)
        pages = _pages(chunked_server.url, doc_id)
        assert len(pages) == max(1, math.ceil(len(body.split()) / PAGE_TOKENS))
        assert [(p["id"], p["page"], p["pages"]) for p in pages] == [(doc_id, k, len(pages)) for k in range(len(pages))]
        assert all(p["contents"].startswith(head) for p in pages)
        assert all(len(split_title(p["contents"])[1].split()) <= PAGE_TOKENS for p in pages)
        assert "".join(split_title(p["contents"])[1] for p in pages) == body  # whitespace and newlines included


def test_documents_several_ids_in_order(chunked_server, documents_corpus):
    ids = ["borealis", "atlas", "borealis"]
    resp = _documents(chunked_server.url, {"ids": ids, "page": 1})
    assert resp.status_code == 200, resp.text
    result = resp.json()["result"]
    assert [r["id"] for r in result] == ids and [r["page"] for r in result] == [1, 1, 1]
    assert result[1]["pages"] == math.ceil(730 / PAGE_TOKENS) and result[0] == result[2]
    assert _documents(chunked_server.url, {"ids": ["atlas"], "page": None}).json()["result"][0]["page"] == 0


DOCUMENTS_BAD = {
    "unknown_id": ({"ids": ["atlas", "no-such-doc"]}, 404, "no-such-doc"),
    "unknown_passage_id": ({"ids": ["atlas#0"]}, 404, "atlas#0"),  # a passage id is not a document id
    "page_past_end": ({"ids": ["atlas"], "page": 8}, 422, "8 pages"),
    "page_past_end_of_one": ({"ids": ["atlas", "short"], "page": 1}, 422, "'short'"),
    "page_negative": ({"ids": ["atlas"], "page": -1}, 422, "page"),
    "page_string": ({"ids": ["atlas"], "page": "1"}, 422, "page"),
    "page_float": ({"ids": ["atlas"], "page": 1.5}, 422, "page"),
    "page_bool": ({"ids": ["atlas"], "page": True}, 422, "page"),
    "page_bignum": (b'{"ids": ["atlas"], "page": 1000000000000000000000000000000}', 422, "page"),
    "page_huge": ({"ids": ["atlas"], "page": 2**62}, 422, "past the end"),
    "ids_missing": ({"page": 0}, 422, "ids"),
    "ids_string": ({"ids": "atlas"}, 422, "ids"),
    "ids_null": ({"ids": None}, 422, "ids"),
    "ids_object": ({"ids": {"atlas": 1}}, 422, "ids"),
    "ids_int_items": ({"ids": [1, 2]}, 422, "ids[0]"),
    "ids_nested": ({"ids": [["atlas"]]}, 422, "ids[0]"),
    "ids_empty_list": ({"ids": []}, 422, "empty"),
    "ids_empty_string": ({"ids": [""]}, 422, "ids[0]"),
    "ids_too_many": ({"ids": ["atlas"] * 5}, 422, "too many"),  # the server runs with --max-document-ids 4
    "id_too_long": ({"ids": ["x" * 5000]}, 422, "ids[0]"),
    "body_array": (b'["atlas"]', 422, "object"),
    "body_malformed": (b'{"ids": ["atlas"', 400, "JSON"),
    "body_not_utf8": (b"\xff\xfe\xfa", 400, "JSON"),
    "body_empty": (b"", 400, "JSON"),
}


def test_documents_bad_input_is_4xx_and_the_server_stays_up(chunked_server):
    url = chunked_server.url
    for name, (body, status, named) in DOCUMENTS_BAD.items():
        resp = _documents(url, body)
        assert resp.status_code == status, (name, resp.status_code, resp.text[:300])
        detail = resp.json()["detail"]
        assert isinstance(detail, str) and named in detail, (name, detail)
    assert _documents(url, {"ids": ["atlas"]}, {"authorization": "Bearer wrong"}).status_code == 401
    no_token = httpx.post(f"{url}/documents", json={"ids": ["atlas"]}, timeout=60)
    assert no_token.status_code == 401 and no_token.json()["detail"]
    wrong_method = httpx.get(f"{url}/documents", headers=AUTH, timeout=60)
    assert wrong_method.status_code == 405 and wrong_method.json()["detail"]
    huge = b'{"ids": ["' + b"x" * (9 << 20) + b'"]}'  # over the 8 MiB body limit
    assert _documents(url, huge).status_code == 413
    # still serving both endpoints, and nothing above was counted as a server error
    assert _documents(url, {"ids": ["short"]}).json()["result"][0]["id"] == "short"
    retrieve = httpx.post(f"{url}/retrieve", json={"queries": ["zeppelin"], "topk": 1}, headers=AUTH, timeout=60)
    assert retrieve.status_code == 200 and retrieve.json()["result"][0][0]["doc_id"] == "borealis"
    assert "internal error" not in chunked_server.log.read_text()


def test_health_reports_documents(chunked_server, unchunked_server, documents_corpus):
    health = chunked_server.health()
    assert health["status"] == "ok" and health["n_documents"] == len(documents_corpus[1])
    assert health["chunk_tokens"] == CHUNK_TOKENS and health["n_docs"] > health["n_documents"]
    assert health["limits"]["page_tokens"] == PAGE_TOKENS and health["limits"]["max_document_ids"] == 4
    plain = unchunked_server.health()
    assert plain["chunk_tokens"] == 0 and plain["n_docs"] == plain["n_documents"] == len(documents_corpus[1])


# ---- --chunk-tokens 0: as before ------------------------------------------------------------------------------------
def test_unchunked_build_is_byte_for_byte_as_before(unchunked_index, documents_corpus):
    """One passage per corpus line, `{"id", "contents"}` JSON back to back, as the store was written before chunking
    existed; the manifest gains no key (so its fingerprint is unchanged)."""
    lines = documents_corpus[0].read_text(encoding="utf-8").splitlines()
    records = [json.dumps(json.loads(line), ensure_ascii=False).encode() for line in lines]
    store_dir = unchunked_index / "corpus"
    assert (store_dir / "contents.bin").read_bytes() == b"".join(records)
    assert np.load(store_dir / "offsets.npy").tolist() == np.cumsum([0] + [len(r) for r in records]).tolist()
    assert sorted(p.name for p in store_dir.iterdir()) == ["contents.bin", "offsets.npy"]
    assert "chunk_tokens" not in json.loads((unchunked_index / "manifest.json").read_text())


@pytest.mark.parametrize("with_scores", [True, False])
def test_unchunked_retrieve_is_as_before_and_documents_are_served(unchunked_server, documents_corpus, with_scores):
    body = {"queries": ["quokka saffron lighthouse"], "topk": 3, "return_scores": with_scores}
    hits = httpx.post(f"{unchunked_server.url}/retrieve", json=body, timeout=60).json()["result"][0]
    docs = [h["document"] for h in hits] if with_scores else hits
    assert all(set(d) == {"id", "contents"} for d in docs) and docs[0]["id"] == "atlas"
    assert docs[0]["contents"] == documents_corpus[1]["atlas"]
    pages = _pages(unchunked_server.url, "atlas")  # an unchunked index serves its lines as documents too
    assert "".join(split_title(p["contents"])[1] for p in pages) == split_title(documents_corpus[1]["atlas"])[1]


def test_rebuild_with_other_chunking_is_refused_and_resume_keeps_the_index(chunked_index, tmp_path, documents_corpus):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(chunked_index, copy)
    with pytest.raises(ValueError, match="--chunk-tokens 50, not 0"):
        build_index(str(documents_corpus[0]), "bm25", "flat", str(copy))
    assert (copy / "manifest.json").exists()  # the refused build touched nothing
    before = (copy / "corpus" / "contents.bin").read_bytes()
    build_index(str(documents_corpus[0]), "bm25", "flat", str(copy), chunk_tokens=CHUNK_TOKENS)  # resumes
    assert (copy / "corpus" / "contents.bin").read_bytes() == before and (copy / "documents.sqlite").exists()


def test_chunked_build_refuses_duplicate_document_ids(tmp_path):
    corpus = tmp_path / "dup.jsonl"
    line = json.dumps({"id": "same", "contents": '"T"\nsome words here'})
    corpus.write_text(f"{line}\n{line}\n")
    with pytest.raises(ValueError, match="dup.jsonl:2: duplicate document id 'same'"):
        build_index(str(corpus), "bm25", "flat", str(tmp_path / "idx"), chunk_tokens=2)
    assert not (tmp_path / "idx").exists()  # a failed build in a directory it made leaves nothing
