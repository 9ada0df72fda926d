"""The eval gate's decision: task metric, NLL and agreement against the baseline, task metric against serving."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.specs import EvalGate, EvalMetric
from evaluation.datasets import EvalExample, EvalSet
from evaluation.engine_eval import EvalResult, score
from evaluation.gate import GateThresholds, decide, worst_examples

REFERENCES = [f"Sentence number {i} is right." for i in range(100)]
EVAL_SET = EvalSet("toy", [EvalExample(f"e{i}", [{"role": "user", "content": f"sentence number {i} is wrong."}],
                                       ref, "toy") for i, ref in enumerate(REFERENCES)], ["Some text."])


def result(correct: int, nll: float = 2.0, wrong: str = "Wrong answer.", label: str = "m") -> EvalResult:
    """The first ``correct`` examples answered exactly, the rest with ``wrong``."""
    outputs = {e.id: (e.reference if i < correct else wrong) for i, e in enumerate(EVAL_SET.examples)}
    return score(EVAL_SET, outputs, [[-nll]], model=label, duration_s=1.0)


def with_nll(base: EvalResult, nll: float) -> EvalResult:
    return EvalResult(**{**base.__dict__, "nll": nll})


DEFAULTS = GateThresholds()


def test_thresholds_come_from_the_spec_and_default_to_its_defaults():
    assert GateThresholds.from_spec(EvalGate()) == DEFAULTS == GateThresholds("exact_match", 0.05, 0.02, 0.5, 0.05)
    spec = EvalGate(metric=EvalMetric.similarity, max_regression=0.05, max_nll_increase=0.1, min_agreement=0.8,
                    significance=0.2)
    assert GateThresholds.from_spec(spec) == GateThresholds("similarity", 0.05, 0.1, 0.8, 0.2)


def test_unknown_metric_is_refused_when_the_thresholds_are_made():
    with pytest.raises(KeyError, match="exact_match, similarity"):
        GateThresholds(metric="bleu")


def test_a_candidate_equal_to_the_baseline_passes_every_check():
    decision = decide(result(41), result(41), result(41), DEFAULTS, EVAL_SET)
    assert decision.passed and decision.reasons == [] and decision.worst_examples == []
    assert [c.name for c in decision.checks] == [
        "exact_match vs baseline", "NLL vs baseline", "agreement with baseline", "exact_match vs serving"]
    assert all(c.passed for c in decision.checks)


def test_each_check_reports_the_values_and_the_bound():
    decision = decide(result(40, nll=2.03), result(41, nll=2.0), None, DEFAULTS, EVAL_SET)
    assert decision.passed
    task, nll, agree = decision.checks
    assert task.summary == "exact_match vs baseline: 0.410 → 0.400 (drop 0.010 ≤ 0.050)"
    assert (task.reference, task.candidate, task.bound) == (0.41, 0.40, 0.05)
    assert task.measured == pytest.approx(0.01)
    assert nll.measured == pytest.approx(0.015) and "rise 1.50% ≤ 2.00%" in nll.summary
    assert agree.measured == 0.99 and agree.summary == "agreement with baseline: 0.990 (≥ 0.500)"


@pytest.mark.parametrize("baseline_correct, candidate_correct, passed", [
    (41, 41, True), (41, 39, True),  # a drop of exactly max_regression passes (0.41 − 0.39 in floating point)
    (41, 38, False), (41, 60, True),
])
def test_the_task_metric_may_drop_by_at_most_max_regression(baseline_correct, candidate_correct, passed):
    thresholds = GateThresholds(max_regression=0.02, min_agreement=0.0, significance=1.0)  # every drop counts
    decision = decide(result(candidate_correct), result(baseline_correct), None, thresholds, EVAL_SET)
    assert decision.passed is passed
    assert decision.checks[0].passed is passed


def test_a_task_regression_names_the_metric_the_values_and_eval_gate_max_regression():
    decision = decide(result(35), result(41), None, DEFAULTS, EVAL_SET)
    assert not decision.passed
    [reason] = decision.reasons
    assert "exact_match" in reason and "0.410" in reason and "0.350" in reason and "0.060" in reason
    assert "eval_gate.max_regression" in reason


def answers(right: set[int], label: str = "m") -> EvalResult:
    """Examples whose index is in ``right`` answered exactly, the others wrongly."""
    outputs = {e.id: (e.reference if i in right else "Wrong answer.") for i, e in enumerate(EVAL_SET.examples)}
    return score(EVAL_SET, outputs, [[-2.0]], model=label, duration_s=1.0)


BASELINE_RIGHT = set(range(41))


@pytest.mark.parametrize("lost, gained, significance, passed, why", [
    (6, 0, 0.05, False, "drop 0.06 > 0.05 and McNemar p = 1/64 = 0.016: a regression"),
    (6, 1, 0.05, True, "drop 0.05, not beyond the bound"),
    (8, 2, 0.05, True, "drop 0.06 but p = 56/1024 = 0.055: within noise"),
    (8, 2, 0.10, False, "the same drop at significance 0.10 is a regression"),
    (8, 2, 1.00, False, "significance 1.0: every drop beyond the bound fails"),
    (20, 14, 0.05, True, "drop 0.06 but p = 0.196: two models that disagree a lot"),
])
def test_a_drop_is_a_regression_only_beyond_the_bound_and_unlikely_to_be_noise(lost, gained, significance, passed,
                                                                               why):
    candidate_right = (BASELINE_RIGHT - set(range(lost))) | set(range(41, 41 + gained))
    thresholds = GateThresholds(min_agreement=0.0, significance=significance)
    decision = decide(answers(candidate_right), answers(BASELINE_RIGHT), None, thresholds, EVAL_SET)
    task = decision.checks[0]
    assert task.passed is passed, why
    assert (task.paired.worse, task.paired.better, task.paired.n) == (lost, gained, 100)
    low, high = task.paired.interval
    assert low <= task.measured <= high
    if not passed:
        assert "eval_gate.significance" in task.reason and f"p = {task.paired.p_value:.3f}" in task.reason


def test_a_drop_within_noise_says_so_in_its_summary():
    candidate_right = (BASELINE_RIGHT - set(range(8))) | {41, 42}
    task = decide(answers(candidate_right), answers(BASELINE_RIGHT), None, DEFAULTS, EVAL_SET).checks[0]
    assert "within noise" in task.summary and "100 examples" in task.summary and "p = 0.055" in task.summary


def test_the_similarity_metric_is_judged_by_a_paired_test_too():
    thresholds = GateThresholds(metric="similarity", min_agreement=0.0)
    decision = decide(result(0, wrong="Sentence."), result(41), None, thresholds, EVAL_SET)
    assert not decision.passed and decision.checks[0].paired.test.startswith("sign-flip")


def test_a_candidate_whose_nll_rose_5_percent_fails_with_a_reason_naming_max_nll_increase():
    decision = decide(result(41, nll=2.1), result(41, nll=2.0), None, DEFAULTS, EVAL_SET)
    assert not decision.passed
    [reason] = decision.reasons
    assert "eval_gate.max_nll_increase" in reason and "5.00%" in reason and "2.1000" in reason


@pytest.mark.parametrize("candidate_nll, passed", [(2.04, True), (2.0401, False), (1.5, True)])
def test_nll_may_rise_by_at_most_max_nll_increase_relative_to_the_baseline(candidate_nll, passed):
    decision = decide(result(41, nll=candidate_nll), result(41, nll=2.0), None, DEFAULTS, EVAL_SET)
    assert decision.passed is passed


@pytest.mark.parametrize("bad_nll", [math.nan, math.inf])
def test_a_non_finite_candidate_nll_fails_whatever_the_threshold(bad_nll):
    thresholds = GateThresholds(max_nll_increase=1e9)
    decision = decide(with_nll(result(41), bad_nll), result(41), None, thresholds, EVAL_SET)
    assert not decision.passed
    [reason] = decision.reasons
    assert "not a finite number" in reason and str(bad_nll) in reason


@pytest.mark.parametrize("baseline_nll", [0.0, math.nan, math.inf])
def test_a_baseline_nll_of_zero_or_not_finite_fails_with_a_clear_reason(baseline_nll):
    decision = decide(result(41), with_nll(result(41), baseline_nll), None, DEFAULTS, EVAL_SET)
    assert not decision.passed
    [reason] = decision.reasons
    assert "baseline" in reason and "relative rise cannot be measured" in reason


def test_agreement_below_min_agreement_fails_naming_eval_gate_min_agreement():
    # Both get the same 41 right; the candidate words its wrong answers differently.
    decision = decide(result(41, wrong="Other."), result(41), None, DEFAULTS, EVAL_SET)
    assert not decision.passed
    [reason] = decision.reasons
    assert "0.410" in reason and "eval_gate.min_agreement" in reason
    assert decide(result(41, wrong="Other."), result(41), None, GateThresholds(min_agreement=0.41),
                  EVAL_SET).passed


def test_the_candidate_must_also_hold_up_against_the_serving_revision():
    decision = decide(result(41), result(41), result(50), DEFAULTS, EVAL_SET)
    assert not decision.passed
    [reason] = decision.reasons
    assert "serving" in reason and "0.500" in reason and "eval_gate.max_regression" in reason


def test_no_serving_revision_means_no_serving_check():
    assert [c.name for c in decide(result(41), result(41), None, DEFAULTS, EVAL_SET).checks] == [
        "exact_match vs baseline", "NLL vs baseline", "agreement with baseline"]


def test_the_similarity_metric_compares_similarity():
    thresholds = GateThresholds(metric="similarity", min_agreement=0.0)
    decision = decide(result(41, wrong="Sentence number 1 is wrong."), result(41, wrong="xx"), None,
                      thresholds, EVAL_SET)
    assert decision.checks[0].name == "similarity vs baseline"
    assert decision.passed  # more similar wrong answers: similarity rose


def test_several_failures_give_several_reasons_and_the_summary_lists_them():
    decision = decide(with_nll(result(0, wrong="?"), math.nan), result(41), result(41), DEFAULTS, EVAL_SET)
    assert len(decision.reasons) == 4
    text = decision.summary()
    assert text.startswith("eval gate FAILED") and text.count("FAIL ") == 4


def test_results_of_different_evaluation_sets_are_not_compared():
    other = EvalResult(**{**result(41).__dict__, "dataset": "other"})
    with pytest.raises(ValueError, match="different evaluation sets"):
        decide(result(41), other, None, DEFAULTS, EVAL_SET)


def test_worst_examples_list_baseline_correct_candidate_wrong_first():
    outputs_base = {e.id: e.reference for e in EVAL_SET.examples}
    outputs_cand = dict(outputs_base)
    outputs_cand["e3"] = "Sentence number 3 is rightt."  # lost the exact match, similarity barely moved
    outputs_base["e5"], outputs_cand["e5"] = "Sentence number 5 is rihgt.", "Nonsense."  # both wrong, far worse
    outputs_base["e7"], outputs_cand["e7"] = "Sentence 7 is right.", "Sentence 7 is rite."  # both wrong, a bit worse
    outputs_base["e9"], outputs_cand["e9"] = "Nonsense.", "Sentence number 9 is right."  # the candidate is better
    baseline = score(EVAL_SET, outputs_base, [[-2.0]], model="baseline", duration_s=1.0)
    candidate = score(EVAL_SET, outputs_cand, [[-2.0]], model="candidate", duration_s=1.0)
    worst = worst_examples(candidate, baseline, EVAL_SET)
    assert [w.id for w in worst] == ["e3", "e5", "e7"]
    first = worst[0]
    assert (first.prompt, first.reference) == ("sentence number 3 is wrong.", "Sentence number 3 is right.")
    assert (first.baseline_output, first.candidate_output) == ("Sentence number 3 is right.",
                                                               "Sentence number 3 is rightt.")
    assert first.baseline_similarity == 1.0 > first.candidate_similarity
    assert first.to_row() | {"candidate_similarity": None} == {
        "id": "e3", "input": "sentence number 3 is wrong.", "reference": "Sentence number 3 is right.",
        "baseline": "Sentence number 3 is right.", "candidate": "Sentence number 3 is rightt.",
        "baseline_similarity": 1.0, "candidate_similarity": None}


def test_worst_examples_are_at_most_ten_and_come_with_the_decision():
    decision = decide(result(0), result(41), None, DEFAULTS, EVAL_SET)
    worst = decision.worst_examples
    assert len(worst) == 10
    assert all(w.baseline_output == w.reference != w.candidate_output for w in worst)  # the 41 lost answers
    drops = [w.baseline_similarity - w.candidate_similarity for w in worst]
    assert drops == sorted(drops, reverse=True)


@given(st.integers(0, 100), st.integers(0, 100), st.floats(0.5, 5.0), st.floats(0.5, 5.0))
def test_passing_means_every_check_passed_and_each_failure_has_one_reason(base_ok, cand_ok, base_nll, cand_nll):
    decision = decide(result(cand_ok, nll=cand_nll), result(base_ok, nll=base_nll), None, DEFAULTS, EVAL_SET)
    assert decision.passed == all(c.passed for c in decision.checks)
    assert len(decision.reasons) == sum(not c.passed for c in decision.checks)
    assert all("eval_gate." in reason for reason in decision.reasons)
