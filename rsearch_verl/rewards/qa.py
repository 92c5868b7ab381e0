"""Answer metrics for open-domain QA, by the standard definitions the papers' numbers use.

    from rsearch_verl.rewards.qa import exact_match, f1_score, cover_exact_match
    exact_match("The Eiffel Tower!", ["eiffel tower"])      -> 1.0
    f1_score("Paris, France", "Paris")                      -> 0.666…
    cover_exact_match("Charles Darwin's theory", "darwin")  -> 1.0   (the gold is a substring of the prediction)
    METRICS["cover_em_token"]("Parisian food", "paris")     -> 0.0   (a named, stricter variant)

Defaults (what training rewards, `python -m rsearch_verl.eval` and the papers report):
* `normalize_answer` is SQuAD's: lower-case, remove ASCII punctuation (`string.punctuation`), drop the articles
  a/an/the, collapse whitespace. Nothing else: no Unicode punctuation folding, no NFC.
* `exact_match`: the normalised prediction equals a normalised gold (SQuAD EM; Search-R1 `em`; FlashRAG `em`).
* `f1_score`: SQuAD token F1 on normalised text; yes / no / noanswer are all-or-nothing (the HotpotQA script and
  FlashRAG `f1` do that: "no" gets no credit against "no answer").
* `cover_exact_match`: a normalised gold is a substring of the normalised prediction (Search-R1 `subem`,
  FlashRAG `acc`).
`golds` is one string or a list; every metric takes the max over golds. A prediction of None (no answer extracted)
scores 0.0; any string, even empty, is compared by the definition (so a gold that normalises to "" matches).

Named variants, never defaults (`METRICS[name]`): `*_unicode` normalise with `normalize_answer_unicode` (Unicode
punctuation folded, NFC: “Paris” == Paris, decomposed Zürich == Zürich) and `cover_em_token` needs the gold as
whole tokens ("Parisian" does not cover "paris").
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable
from functools import partial

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ASCII_PUNCT = frozenset(string.punctuation)
_SPECIAL = frozenset({"yes", "no", "noanswer"})

Normalizer = Callable[[str], str]


def _check(s: object) -> None:
    if not isinstance(s, str):
        raise TypeError(f"answer must be a string, got {type(s).__name__}")


def normalize_answer(s: str | None) -> str:
    """SQuAD normalisation: lower, drop ASCII punctuation, drop articles, collapse whitespace. None -> ""."""
    if s is None:
        return ""
    _check(s)
    text = "".join(ch for ch in s.lower() if ch not in _ASCII_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_answer_unicode(s: str | None) -> str:
    """Our stricter-about-Unicode variant: NFC, then every Unicode punctuation character dropped, then as SQuAD."""
    if s is None:
        return ""
    _check(s)
    text = unicodedata.normalize("NFC", s).lower()
    text = "".join(ch for ch in text if ch not in _ASCII_PUNCT and not unicodedata.category(ch).startswith("P"))
    return " ".join(_ARTICLES.sub(" ", text).split())


def _as_golds(golds: str | Iterable[str] | None) -> list[str]:
    if golds is None:
        return []
    if isinstance(golds, str):
        return [golds]
    return [str(g) for g in golds]


def exact_match(
    pred: str | None, golds: str | Iterable[str] | None, normalizer: Normalizer = normalize_answer
) -> float:
    """1.0 when the normalised prediction equals some normalised gold, else 0.0."""
    if pred is None:
        return 0.0
    p = normalizer(pred)
    return float(any(p == normalizer(g) for g in _as_golds(golds)))


def _f1_one(pred_norm: str, gold_norm: str) -> float:
    if (pred_norm in _SPECIAL or gold_norm in _SPECIAL) and pred_norm != gold_norm:
        return 0.0
    pred_toks, gold_toks = pred_norm.split(), gold_norm.split()
    common = sum((Counter(pred_toks) & Counter(gold_toks)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_toks), common / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def f1_score(pred: str | None, golds: str | Iterable[str] | None, normalizer: Normalizer = normalize_answer) -> float:
    """Token-level F1 between normalised prediction and gold, max over golds."""
    if pred is None:
        return 0.0
    p = normalizer(pred)
    return max((_f1_one(p, normalizer(g)) for g in _as_golds(golds)), default=0.0)


def cover_exact_match(
    pred: str | None, golds: str | Iterable[str] | None, normalizer: Normalizer = normalize_answer
) -> float:
    """1.0 when some normalised gold is a substring of the normalised prediction."""
    if pred is None:
        return 0.0
    p = normalizer(pred)
    return float(any(normalizer(g) in p for g in _as_golds(golds)))


def token_cover_exact_match(
    pred: str | None, golds: str | Iterable[str] | None, normalizer: Normalizer = normalize_answer
) -> float:
    """1.0 when some non-empty normalised gold appears as whole tokens inside the normalised prediction."""
    if pred is None:
        return 0.0
    padded = f" {normalizer(pred)} "
    return float(any(gn and f" {gn} " in padded for gn in map(normalizer, _as_golds(golds))))


MetricFn = Callable[[str | None, "str | Iterable[str] | None"], float]
METRICS: dict[str, MetricFn] = {
    "em": exact_match,
    "f1": f1_score,
    "cover_em": cover_exact_match,
    "cover_em_token": token_cover_exact_match,
    "em_unicode": partial(exact_match, normalizer=normalize_answer_unicode),
    "f1_unicode": partial(f1_score, normalizer=normalize_answer_unicode),
    "cover_em_unicode": partial(cover_exact_match, normalizer=normalize_answer_unicode),
}
