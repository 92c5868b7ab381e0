"""Answer normalisation and the EM / F1 / cover-EM contract of DESIGN.md."""

import pytest

from rsearch_verl.rewards.qa import cover_exact_match, exact_match, f1_score, normalize_answer


def test_normalize():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("An apple, a day") == "apple day"
    assert normalize_answer("«Zürich»…") == "zürich"
    assert normalize_answer("theory") == "theory"  # articles only as whole words
    assert normalize_answer(None) == ""
    with pytest.raises(TypeError):
        normalize_answer(3)


def test_exact_match_multiple_golds_and_empty():
    assert exact_match("the eiffel tower", ["Eiffel Tower", "Tour Eiffel"]) == 1.0
    assert exact_match("Tour Eiffel.", ["Eiffel Tower", "Tour Eiffel"]) == 1.0
    assert exact_match("Paris", "paris") == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0
    assert exact_match("", ["Paris"]) == 0.0
    assert exact_match(None, ["Paris"]) == 0.0
    assert exact_match("the", ["a"]) == 0.0  # both normalise to empty: not a match
    assert exact_match("Paris", []) == 0.0


def test_unicode_not_folded():
    assert exact_match("Zürich", ["Zurich"]) == 0.0
    assert exact_match("ZÜRICH", ["zürich"]) == 1.0
    assert exact_match("東京", ["東京"]) == 1.0
    # NFC vs NFD spelling of the same word
    assert exact_match("Zu\u0308rich", ["Z\u00fcrich"]) == 1.0


def test_f1():
    assert f1_score("Paris, France", "Paris") == pytest.approx(2 / 3)
    assert f1_score("Paris", ["Lyon", "Paris France"]) == pytest.approx(2 / 3)
    assert f1_score("new york city", ["New York"]) == pytest.approx(0.8)
    assert f1_score("", ["x"]) == 0.0
    assert f1_score("no", ["no answer"]) == 0.0  # yes/no answers are all-or-nothing
    assert f1_score("yes", ["Yes"]) == 1.0
    assert f1_score("x b b", ["b b c"]) == pytest.approx(2 / 3)
    assert f1_score("a b b", ["b b c"]) == pytest.approx(0.8)  # "a" is an article: dropped


def test_cover_exact_match():
    assert cover_exact_match("It is in Paris, France.", ["paris", "lyon"]) == 1.0
    assert cover_exact_match("Parisian food", ["paris"]) == 0.0  # whole tokens only
    assert cover_exact_match("The answer is New York City", ["new york"]) == 1.0
    assert cover_exact_match(None, ["x"]) == 0.0
    assert cover_exact_match("anything", [""]) == 0.0
