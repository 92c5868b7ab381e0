"""Answer metrics for open-domain QA: SQuAD-style normalisation, exact match, token F1, cover EM.

    from rsearch_verl.rewards.qa import exact_match, f1_score, cover_exact_match
    exact_match("The Eiffel Tower!", ["eiffel tower"])      -> 1.0
    f1_score("Paris, France", "Paris")                      -> 0.666…
    cover_exact_match("It is in Paris.", ["paris", "lyon"]) -> 1.0

`golds` is one string or a list of strings; every metric takes the max over golds. A prediction that is
None or empty scores 0.0. Normalisation lower-cases, removes punctuation (ASCII and Unicode), removes the
articles a/an/the and collapses whitespace; letters with accents are kept (Unicode NFC), so "Zürich" never
silently equals "Zurich".
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_ASCII_PUNCT = frozenset(string.punctuation)
# Token-level F1 treats these answers as all-or-nothing (as the SQuAD/HotpotQA scripts do): "no" must not
# get partial credit against "no answer".
_SPECIAL = frozenset({"yes", "no", "noanswer"})


def _is_punct(ch: str) -> bool:
    return ch in _ASCII_PUNCT or unicodedata.category(ch).startswith("P")


def normalize_answer(s: str | None) -> str:
    """Lower-case, strip punctuation, drop articles, collapse whitespace. None -> ""."""
    if s is None:
        return ""
    if not isinstance(s, str):
        raise TypeError(f"answer must be a string, got {type(s).__name__}")
    text = unicodedata.normalize("NFC", s).lower()
    text = "".join(ch for ch in text if not _is_punct(ch))
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _as_golds(golds: str | Iterable[str] | None) -> list[str]:
    if golds is None:
        return []
    if isinstance(golds, str):
        return [golds]
    out = [str(g) for g in golds]
    return out


def exact_match(pred: str | None, golds: str | Iterable[str] | None) -> float:
    """1.0 when the normalised prediction equals some normalised gold, else 0.0."""
    p = normalize_answer(pred)
    if not p:
        return 0.0
    return float(any(p == normalize_answer(g) for g in _as_golds(golds)))


def _f1_one(pred_norm: str, gold_norm: str) -> float:
    if pred_norm in _SPECIAL or gold_norm in _SPECIAL:
        return float(pred_norm == gold_norm)
    pred_toks, gold_toks = pred_norm.split(), gold_norm.split()
    if not pred_toks or not gold_toks:
        return 0.0
    common = sum((Counter(pred_toks) & Counter(gold_toks)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_toks), common / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def f1_score(pred: str | None, golds: str | Iterable[str] | None) -> float:
    """Token-level F1 between normalised prediction and gold, max over golds."""
    p = normalize_answer(pred)
    if not p:
        return 0.0
    return max((_f1_one(p, normalize_answer(g)) for g in _as_golds(golds)), default=0.0)


def cover_exact_match(pred: str | None, golds: str | Iterable[str] | None) -> float:
    """1.0 when some normalised gold appears as a whole-token span inside the normalised prediction."""
    p = normalize_answer(pred)
    if not p:
        return 0.0
    padded = f" {p} "
    for g in _as_golds(golds):
        gn = normalize_answer(g)
        if gn and f" {gn} " in padded:
            return 1.0
    return 0.0
