"""Scoring answers: normalization, exact match, similarity, agreement and per-token NLL."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evaluation.metrics import agreement, exact_match, mean_nll, normalize, similarity, task_score


@pytest.mark.parametrize("answer, normalized", [
    ("She goes home.", "She goes home."),
    ("  She   goes\thome.  ", "She goes home."),
    ("She goes home.\nI changed 'go' to 'goes'.", "She goes home."),
    ("\n\nShe goes home.\n", "She goes home."),
    ('"She goes home."', "She goes home."),
    ("'She goes home.'", "She goes home."),
    ("\u201cShe goes home.\u201d", "She goes home."),
    ('" She goes home. "', "She goes home."),
    ("", ""),
    ("   \n  ", ""),
    ('"', '"'),  # a lone quote is not a pair of surrounding quotes
])
def test_normalize_keeps_the_first_line_without_extra_spaces_or_quotes(answer, normalized):
    assert normalize(answer) == normalized


def test_normalize_keeps_case_and_punctuation_because_they_can_be_the_correction():
    assert normalize("she goes home") != normalize("She goes home.")


@pytest.mark.parametrize("output, reference, expected", [
    ("She goes home.", "She goes home.", 1.0),
    ('  "She goes home."\nHope this helps!', "She goes home.", 1.0),
    ("she goes home.", "She goes home.", 0.0),
    ("She go home.", "She goes home.", 0.0),
    ("", "She goes home.", 0.0),
])
def test_exact_match_compares_normalized_answers(output, reference, expected):
    assert exact_match(output, reference) == expected


def test_similarity_is_the_sequence_matcher_ratio_of_normalized_text():
    assert similarity("She goes home.", "She goes home.") == 1.0
    assert similarity("She go home.", "She goes home.") == pytest.approx(24 / 26)
    assert similarity("xyz", "She goes home.") < 0.2
    assert similarity('"She goes home."\nExplanation: ...', "She goes home.") == 1.0


@given(st.text(max_size=40), st.text(max_size=40))
def test_similarity_is_between_0_and_1_and_1_exactly_for_an_exact_match(output, reference):
    value = similarity(output, reference)
    assert 0.0 <= value <= 1.0
    assert (value == 1.0) == (exact_match(output, reference) == 1.0)


@pytest.mark.parametrize("metric, expected", [("exact_match", 0.5), ("similarity", (1 + 24 / 26) / 2)])
def test_task_score_is_the_mean_over_examples(metric, expected):
    outputs, references = ["She goes home.", "She go home."], ["She goes home.", "She goes home."]
    assert task_score(metric, outputs, references) == pytest.approx(expected)


def test_task_score_accepts_the_spec_enum():
    from controlplane.specs import EvalMetric

    assert task_score(EvalMetric.exact_match, ["A."], ["A."]) == 1.0


def test_task_score_rejects_unknown_metrics_naming_the_known_ones():
    with pytest.raises(KeyError, match="exact_match, similarity"):
        task_score("bleu", ["A."], ["A."])


@pytest.mark.parametrize("outputs, references", [([], []), (["A."], ["A.", "B."])])
def test_task_score_needs_one_output_per_reference_and_at_least_one(outputs, references):
    with pytest.raises(ValueError):
        task_score("exact_match", outputs, references)


def test_agreement_is_the_share_of_identical_normalized_answers():
    assert agreement(["A.", "B.", "C.", "D."], ["A.", " B. ", "c.", "D.\nbecause"]) == 0.75
    assert agreement(["A."], ["A."]) == 1.0
    with pytest.raises(ValueError):
        agreement(["A."], [])


def test_mean_nll_weighs_every_token_equally_across_texts():
    assert mean_nll([[-1.0, -2.0], [-3.0]]) == 2.0
    assert math.exp(mean_nll([[-1.0, -2.0], [-3.0]])) == pytest.approx(7.389, abs=1e-3)  # perplexity


@pytest.mark.parametrize("logprobs, check", [
    ([[-1.0, float("nan")]], math.isnan),
    ([[-1.0, float("-inf")]], lambda v: v == math.inf),
])
def test_mean_nll_of_broken_logprobs_is_not_finite(logprobs, check):
    assert check(mean_nll(logprobs))


def test_mean_nll_of_no_tokens_is_an_error():
    with pytest.raises(ValueError):
        mean_nll([[], []])


@given(st.lists(st.lists(st.floats(min_value=-50, max_value=0), max_size=8), min_size=1).filter(
    lambda texts: any(texts)))
def test_mean_nll_lies_between_the_smallest_and_largest_token_nll(texts):
    tokens = [-lp for text in texts for lp in text]
    assert min(tokens) - 1e-9 <= mean_nll(texts) <= max(tokens) + 1e-9
