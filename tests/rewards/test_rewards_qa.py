"""Answer metrics: the API of rewards/qa.py (the definitions themselves are pinned by tests/rewards/test_parity.py)."""

import pytest

from rsearch_verl.rewards.qa import (
    METRICS,
    cover_exact_match,
    exact_match,
    f1_score,
    normalize_answer,
    normalize_answer_unicode,
)


def test_normalize_is_squads():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("An apple, a day") == "apple day"
    assert normalize_answer("theory") == "theory"  # articles only as whole words
    assert normalize_answer("«Zürich»…") == "«zürich»…"  # non-ASCII punctuation is kept, as in SQuAD
    assert normalize_answer_unicode("«Zürich»…") == "zürich"
    assert normalize_answer(None) == "" and normalize_answer_unicode(None) == ""
    with pytest.raises(TypeError):
        normalize_answer(3)
    with pytest.raises(TypeError):
        normalize_answer_unicode(b"x")


def test_golds_as_string_list_or_none():
    assert exact_match("Paris", "paris") == 1.0
    assert exact_match("Tour Eiffel.", ["Eiffel Tower", "Tour Eiffel"]) == 1.0
    assert exact_match("Paris", []) == 0.0 and exact_match("Paris", None) == 0.0
    assert f1_score("Paris", ["Lyon", "Paris France"]) == pytest.approx(2 / 3)  # max over golds
    assert cover_exact_match("It is in Paris, France.", ["lyon", "paris"]) == 1.0


def test_named_variants():
    assert set(METRICS) == {"em", "f1", "cover_em", "cover_em_token", "em_unicode", "f1_unicode", "cover_em_unicode"}
    assert METRICS["em"] is exact_match and METRICS["cover_em"] is cover_exact_match
    assert METRICS["cover_em_token"]("Parisian food", ["paris"]) == 0.0
    assert METRICS["cover_em_token"]("The answer is New York City", ["new york"]) == 1.0
    assert METRICS["cover_em_token"]("anything", [""]) == 0.0
    assert METRICS["em_unicode"]("\u201cParis\u201d", ["Paris"]) == 1.0
    assert METRICS["f1_unicode"]("Zu\u0308rich!", ["Z\u00fcrich"]) == 1.0
    assert METRICS["cover_em_unicode"]("in Zu\u0308rich", ["Z\u00fcrich"]) == 1.0
