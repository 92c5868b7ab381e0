"""Avg@k and Pass@k over k sampled answers per question, as deep-search papers report them beside EM / F1.

    pass_at_k(n=8, c=3, k=4)                       -> 1 - C(5, 4) / C(8, 4) = 0.929   (Chen et al. 2021, unbiased)
    expected_max_at_k([0.0, 0.5, 1.0], k=2)         -> 0.833   (the same estimator for a graded score such as F1)
    sample_metrics(rows, ("em", "f1"), ks=(1, 4))   -> {"avg@4/em": ..., "pass@1/em": ..., "pass@4/em": ..., ...}

Definitions, per question with n samples (`rollout.val_n`, which `python -m rsearch_verl.eval` takes from the
recipe's overrides, e.g. `rollout.val_n=4 rollout.val_temperature=0.7`):
* Avg@n: the mean score over its n samples; the table's number is the mean of that over questions.
* Pass@k: the expected best score among k of its samples; for a binary score (EM, cover-EM, a judge's verdict)
  the probability that at least one of k is correct. When n == k this is simply the max over the k samples; when
  n > k samples were drawn it is the unbiased estimator over all k-subsets of the n: `1 - C(n-c, k) / C(n, k)` with
  c correct samples, and for a graded score `sum_i s_(i) C(i-1, k-1) / C(n, k)` over the ascending scores s_(1..n)
  (which is the same formula when the scores are 0 / 1). k > n is an error: it cannot be estimated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (1.0 when n - c < k)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def expected_max_at_k(scores: Sequence[float], k: int) -> float:
    """E[max score of k samples drawn without replacement from `scores`]: the max itself when k == len(scores)."""
    n = len(scores)
    if not 1 <= k <= n:
        raise ValueError(f"expected_max_at_k: need 1 <= k <= n, got n={n}, k={k}")
    ranked = sorted(float(s) for s in scores)
    total = math.comb(n, k)
    # the i-th smallest (1-based) is the max of exactly C(i-1, k-1) of the k-subsets
    return sum(s * math.comb(i - 1, k - 1) for i, s in enumerate(ranked, 1)) / total


def group_by_question(rows: Iterable[dict], key: str = "id") -> list[list[dict]]:
    """The rows of each question (same `key`), questions in first-seen order, samples in order."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(str(row[key]), []).append(row)
    return list(groups.values())


def samples_per_question(rows: Iterable[dict], key: str = "id") -> int:
    """The smallest number of samples any question has (0 for no rows): the largest k Pass@k can use."""
    return min((len(g) for g in group_by_question(rows, key)), default=0)


def sample_metrics(rows: list[dict], metrics: Sequence[str], ks: Iterable[int], key: str = "id") -> dict[str, float]:
    """`avg@n/<metric>` (n: samples per question) and `pass@k/<metric>` for each k, means over questions."""
    groups = group_by_question(rows, key)
    if not groups:
        return {}
    n = min(len(g) for g in groups)
    out = {}
    for metric in metrics:
        per_q = [[float(r[metric]) for r in g] for g in groups]
        out[f"avg@{n}/{metric}"] = sum(sum(s) / len(s) for s in per_q) / len(per_q)
        for k in sorted(set(ks)):
            if k > n:
                raise ValueError(f"pass@{k}: only {n} samples per question (raise rollout.val_n)")
            out[f"pass@{k}/{metric}"] = sum(expected_max_at_k(s, k) for s in per_q) / len(per_q)
    return out
