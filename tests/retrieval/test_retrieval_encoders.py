"""Encoder family rules (prefixes, pooling, normalisation) on tiny local BERTs, and the real offline MiniLM."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from retrieval_server.encoders import BGE_QUERY_INSTRUCTION, load_encoder, rules_for

WORDS = "query : passage represent this sentence for searching relevant passages hello world cat who wrote hamlet"


def _tiny_bert(path: Path) -> Path:
    from transformers import BertConfig, BertModel, BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS.split()]
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)
    cfg = BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    base = _tiny_bert(root / "tiny-plain")
    dirs = {"plain": base}
    for family in ("e5", "bge"):  # same weights, a name that selects the family's rules
        d = root / f"tiny-{family}"
        d.symlink_to(base, target_is_directory=True)
        dirs[family] = d
    return dirs


def _manual(path: Path, texts: list[str], pooling: str) -> np.ndarray:
    """The reference computation, written out independently of encoders.py."""
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    out = []
    for t in texts:  # one at a time: no padding involved, so pooling over all tokens is the truth
        with torch.no_grad():
            h = model(**tok(t, return_tensors="pt")).last_hidden_state[0]
        v = h[0] if pooling == "cls" else h.mean(0)
        out.append((v / v.norm()).numpy())
    return np.stack(out)


QUERIES = ["who wrote hamlet", "hello world cat cat cat"]  # different lengths: padding must not leak into means
PASSAGES = ["hamlet", "cat world hello who wrote"]


@pytest.mark.parametrize(
    ("family", "qprefix", "pprefix", "pooling"),
    [("e5", "query: ", "passage: ", "mean"), ("bge", BGE_QUERY_INSTRUCTION, "", "cls"), ("plain", "", "", "mean")],
)
def test_family_rules_match_manual_computation(tiny_dirs, family, qprefix, pprefix, pooling):
    enc = load_encoder(str(tiny_dirs[family]))
    assert rules_for(str(tiny_dirs[family]))[0] == family
    assert enc.pooling == pooling and enc.dim == 32
    q = enc.encode_queries(QUERIES)
    p = enc.encode_passages(PASSAGES)
    assert q.dtype == np.float32 and q.shape == (2, 32)
    np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(q, _manual(tiny_dirs[family], [qprefix + t for t in QUERIES], pooling), atol=1e-5)
    np.testing.assert_allclose(p, _manual(tiny_dirs[family], [pprefix + t for t in PASSAGES], pooling), atol=1e-5)


def test_pooling_override_and_bad_pooling(tiny_dirs):
    enc = load_encoder(str(tiny_dirs["plain"]), pooling="cls")
    np.testing.assert_allclose(enc.encode_queries(QUERIES), _manual(tiny_dirs["plain"], QUERIES, "cls"), atol=1e-5)
    with pytest.raises(ValueError, match="pooling"):
        load_encoder(str(tiny_dirs["plain"]), pooling="max")


def test_named_families_default_to_hub_weights_and_e5_prefix_changes_output(tiny_dirs):
    assert rules_for("e5")[1].default_model == "intfloat/e5-base-v2"
    assert rules_for("bge")[1].default_model == "BAAI/bge-base-en-v1.5"
    # model_path overrides the hub name: "e5" rules on local weights
    e5 = load_encoder("e5", model_path=str(tiny_dirs["plain"]))
    plain = load_encoder(str(tiny_dirs["plain"]))
    assert not np.allclose(e5.encode_queries(QUERIES), plain.encode_queries(QUERIES))
    assert e5.encode_queries([]).shape == (0, 32)


def test_minilm_real_model_ranks_related_passage_first():
    enc = load_encoder("minilm")
    assert enc.dim == 384
    passages = [
        "The Eiffel Tower is a wrought-iron lattice tower in Paris, France.",
        "Photosynthesis converts light energy into chemical energy in plants.",
        "William Shakespeare wrote the tragedy Hamlet around 1600.",
    ]
    q = enc.encode_queries(["who wrote hamlet", "how do plants make energy from sunlight", "tower in paris"])
    p = enc.encode_passages(passages)
    np.testing.assert_allclose(np.linalg.norm(p, axis=1), 1.0, atol=1e-5)
    assert (q @ p.T).argmax(1).tolist() == [2, 1, 0]
    # batching / length sorting does not change the vectors
    enc.batch_size = enc.query_batch_size = 1
    np.testing.assert_allclose(enc.encode_passages(passages), p, atol=1e-5)
    np.testing.assert_allclose(enc.encode_queries(["who wrote hamlet"]), q[:1], atol=1e-5)
