"""Index types and index building: every FAISS type returns the planted passage (synthetic vectors and real MiniLM
text through `build_index` + `load_retriever`), exact re-ranking from the memory-mapped fp16 file, BM25, the
manifest-last contract, resuming an interrupted build, and clear errors for incomplete index directories.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from retrieval_server.build import EMB_DIR, build_index
from retrieval_server.index import INDEX_TYPES, RERANK_FILE, DenseIndex, default_params, rerank_exact
from retrieval_server.retriever import MANIFEST, load_retriever

REPO = Path(__file__).resolve().parents[2]
DENSE_TYPES = ["flat", "hnsw", "hnsw_sq8", "ivfpq", "ivfpq_rerank", "sq8"]
assert sorted(DENSE_TYPES) == sorted(INDEX_TYPES)


def _clustered(n: int, dim: int, nq: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((32, dim)).astype(np.float32)
    x = centers[rng.integers(0, 32, n)] + 0.7 * rng.standard_normal((n, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    planted = rng.choice(n, nq, replace=False)
    q = x[planted] + 0.05 * rng.standard_normal((nq, dim)).astype(np.float32)
    return x, q / np.linalg.norm(q, axis=1, keepdims=True), planted


@pytest.mark.parametrize("index_type", DENSE_TYPES)
def test_each_index_type_finds_planted_vector(index_type, tmp_path):
    x, q, planted = _clustered(3000, 64, 50)
    idx = DenseIndex.create(index_type, 64, n=len(x))
    if idx.needs_training:
        idx.train(x)
    idx.add(x)
    if int(idx.params["rerank_factor"]) > 1:
        idx.write_rerank_vectors(str(tmp_path), [x[:1000].astype(np.float16), x[1000:].astype(np.float16)])
    idx.save(str(tmp_path))
    loaded = DenseIndex.load(str(tmp_path))
    assert loaded.ntotal == len(x) and loaded.index_type == index_type
    assert (loaded.rerank is not None) == (index_type == "ivfpq_rerank")
    scores, rows = loaded.search(q, 3)
    assert rows.shape == (50, 3) and scores.shape == (50, 3)
    assert np.mean(rows[:, 0] == planted) >= 0.95, index_type
    assert np.all(np.diff(scores, axis=1) <= 1e-6)  # best first
    # k larger than the index is clipped, not an error
    assert loaded.search(q[:2], 10**6)[1].shape[1] <= len(x)


def test_rerank_recovers_exact_order_and_handles_padding():
    rng = np.random.default_rng(1)
    vecs = rng.standard_normal((200, 16)).astype(np.float32)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    cand = np.stack([rng.permutation(200)[:20] for _ in range(4)])
    cand[1, 5:] = -1  # FAISS pads short candidate lists with -1
    scores, rows = rerank_exact(q, cand, vecs.astype(np.float16), 3)
    for i in range(4):
        valid = cand[i][cand[i] >= 0]
        exact = valid[np.argsort(-(vecs[valid] @ q[i]))[:3]]
        assert rows[i].tolist() == exact.tolist()
        np.testing.assert_allclose(scores[i], vecs[exact] @ q[i], rtol=2e-2, atol=2e-2)  # fp16 storage
    assert (rerank_exact(q, np.full((4, 5), -1), vecs, 2)[1] == -1).all()


def test_ivfpq_rerank_beats_codes_alone():
    """The point of `ivfpq_rerank`: same compact codes, near-exact top-k once re-scored from the fp16 vectors."""
    x, _, _ = _clustered(4000, 64, 1)
    rng = np.random.default_rng(5)
    q = x[rng.choice(len(x), 100, replace=False)] + 0.3 * rng.standard_normal((100, 64)).astype(np.float32)
    exact = DenseIndex.create("flat", 64)
    exact.add(x)
    truth = exact.search(q, 3)[1]
    idx = DenseIndex.create("ivfpq_rerank", 64, n=len(x), pq_m=4)  # deliberately coarse codes
    idx.train(x)
    idx.add(x)
    idx.rerank = x.astype(np.float16)

    def recall(rows: np.ndarray) -> float:
        return float(np.mean([len(set(r) & set(t)) / 3 for r, t in zip(rows, truth, strict=True)]))

    idx.params["rerank_factor"] = 1
    alone = recall(idx.search(q, 3)[1])
    idx.params["rerank_factor"] = 16
    reranked = recall(idx.search(q, 3)[1])
    assert reranked >= 0.9 and reranked > alone + 0.1, (alone, reranked)


def test_params_validation():
    assert default_params("ivfpq_rerank", 768, 21_000_000)["pq_m"] == 96
    assert default_params("ivfpq_rerank", 768)["rerank_factor"] > 1
    with pytest.raises(ValueError, match="index type"):
        DenseIndex.create("lsh", 8)
    with pytest.raises(ValueError, match="unknown parameters"):
        DenseIndex.create("flat", 8, nprobe=3)
    with pytest.raises(ValueError, match="rerank_factor"):
        DenseIndex.create("ivfpq", 8, rerank_factor=0)
    with pytest.raises(ValueError, match="training vectors"):
        DenseIndex.create("ivfpq", 8, n=100).train(np.zeros((10, 8), np.float32))


def test_cuda_request_on_cpu_faiss_falls_back(tmp_path):
    x, q, _ = _clustered(500, 16, 5)
    idx = DenseIndex.create("flat", 16)
    idx.add(x)
    idx.save(str(tmp_path))
    cpu = DenseIndex.load(str(tmp_path)).search(q, 3)[1]
    on_gpu = DenseIndex.load(str(tmp_path), device="cuda").search(q, 3)[1]  # sharded when GPUs exist, else CPU
    assert (cpu == on_gpu).all()


# ---------------------------------------------------------------------------------------------------------------
# Real text: MiniLM embeddings of the synthetic corpus, built once, indexed with every type
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
    from retrieval_server.encoders import load_encoder

    return load_encoder("minilm")


def _hit_at_1(retriever, pairs: list[tuple[str, str]]) -> float:
    rows, _ = retriever.search([q for q, _ in pairs], 3)
    ids = [d["id"] for d in retriever.docs([r[0] for r in rows])]
    return float(np.mean([i == rel for i, (_, rel) in zip(ids, pairs, strict=True)]))


@pytest.mark.parametrize("index_type", DENSE_TYPES)
def test_every_index_type_serves_planted_passage(index_type, minilm, minilm_index, retrieval_corpus, tmp_path):
    corpus, pairs = retrieval_corpus
    out = tmp_path / index_type
    out.mkdir()
    shutil.copytree(minilm_index / EMB_DIR, out / EMB_DIR)  # the embeddings are reused: only FAISS is built
    build_index(str(corpus), minilm, index_type, str(out))
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["index_type"] == index_type and manifest["encoder"] == "minilm"
    assert (out / RERANK_FILE).exists() == (index_type == "ivfpq_rerank")
    retriever = load_retriever(str(out))
    assert retriever.info["index_type"] == index_type and retriever.n_docs == len(pairs)
    assert _hit_at_1(retriever, pairs[:60]) >= 0.9


def test_bm25_finds_planted_passage(bm25_index, retrieval_corpus):
    retriever = load_retriever(str(bm25_index))
    assert retriever.info["encoder"] == "bm25" and retriever.encoder is None
    assert _hit_at_1(retriever, retrieval_corpus[1][:60]) >= 0.9
    rows, scores = retriever.search(["zzzz qqqq"], 3)  # no known word: no crash, at most k rows
    assert len(rows[0]) <= 3 and len(scores[0]) == len(rows[0])


def test_interrupted_build_resumes_finished_chunks(minilm, retrieval_corpus, tmp_path):
    corpus, pairs = retrieval_corpus
    out = tmp_path / "resume"
    build_index(str(corpus), minilm, "flat", str(out), chunk_size=150)
    chunks = sorted((out / EMB_DIR).glob("chunk_*.npy"))
    assert len(chunks) == 3
    before = {p.name: p.stat().st_mtime_ns for p in chunks}
    # Simulate a crash during the second chunk: no manifest, chunk 1 missing, a half-written temp file left over.
    (out / MANIFEST).unlink()
    chunks[1].unlink()
    (out / EMB_DIR / "chunk_00001.tmp.npy").write_bytes(b"partial")
    with pytest.raises(FileNotFoundError, match="incomplete"):
        load_retriever(str(out))
    build_index(str(corpus), minilm, "flat", str(out), chunk_size=150)
    after = {p.name: p.stat().st_mtime_ns for p in sorted((out / EMB_DIR).glob("chunk_*.npy"))}
    assert after["chunk_00000.npy"] == before["chunk_00000.npy"]  # reused, not re-encoded
    assert after["chunk_00002.npy"] == before["chunk_00002.npy"]
    assert "chunk_00001.npy" in after
    assert _hit_at_1(load_retriever(str(out)), pairs[:30]) >= 0.9


def test_missing_index_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_retriever(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        load_retriever(str(tmp_path))
    cmd = [sys.executable, "-m", "retrieval_server", "serve", "--index", str(tmp_path / "nope"), "--port", "0"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_builds_ivfpq_rerank(retrieval_corpus, tmp_path):
    """The CLI accepts the extra type and its flags (the trainer's retriever service shells out the same way)."""
    corpus, pairs = retrieval_corpus
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "retrieval_server", "build", "--corpus", str(corpus), "--encoder", "minilm"]
    cmd += ["--index-type", "ivfpq_rerank", "--out", str(out), "--nprobe", "16", "--rerank-factor", "8"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    params = json.loads((out / MANIFEST).read_text())["params"]
    assert params["nprobe"] == 16 and params["rerank_factor"] == 8
    assert _hit_at_1(load_retriever(str(out)), pairs[:30]) >= 0.9


def test_misspelled_encoder_fails_before_any_work(retrieval_corpus, tmp_path, capsys):
    from retrieval_server.__main__ import main

    corpus, _ = retrieval_corpus
    out = tmp_path / "typo"
    with pytest.raises(SystemExit) as exc:
        main(["build", "--corpus", str(corpus), "--encoder", "minlm", "--out", str(out)])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # argparse's usage, then one line naming the value and the valid ones
    assert exc.value.code == 2 and "'minlm' (did you mean minilm?)" in last and "e5, bge, minilm, bm25" in last
    assert "Traceback" not in err and not out.exists()


def test_failed_build_leaves_no_half_built_directory(retrieval_corpus, tmp_path):
    corpus, _ = retrieval_corpus
    not_a_model = tmp_path / "empty_encoder"
    not_a_model.mkdir()
    out = tmp_path / "failed"
    with pytest.raises((OSError, ValueError)):  # transformers cannot load an empty directory
        build_index(str(corpus), str(not_a_model), "flat", str(out))
    assert not out.exists()
