"""The eval gate's decision: may a quantized candidate serve? A pure function of three results.

The gate evaluates the candidate, the unquantized baseline and (when one is serving) the
serving revision with ``engine_eval.evaluate`` and hands the results to :func:`decide`. The
candidate passes when every check holds:

1. task metric vs baseline: not a regression (below);
2. NLL vs baseline: ``(candidate − baseline) / baseline ≤ max_nll_increase`` (relative),
   with both NLLs finite and the baseline's above 0;
3. agreement with baseline: the share of identical greedy answers ``≥ min_agreement``;
4. task metric vs serving (if any): not a regression.

A task-metric drop is a regression only when it is larger than ``max_regression`` *and*
unlikely to be noise: the paired one-sided test on the per-example scores
(:mod:`evaluation.paired`: McNemar's exact test for exact match, a sign-flip test for
similarity) gives ``p < significance``. A held-out set of a few hundred answers moves by a
few points between two equally good models; a bound on the drop alone refuses good
checkpoints on noise (an INT8 SmolLM2 measured 0.725 → 0.662 on 80 examples, p ≈ 0.1).
``significance: 1.0`` turns the test off: any drop beyond the bound fails.

Worked example with the defaults (exact_match, 0.05, 0.05, 0.02, 0.5; docs/quantization.md
says why): baseline exact_match 0.41 and NLL 2.00, candidate 0.40 and 2.03, 0.81 of the
answers identical: drop 0.01 ≤ 0.05, rise 1.5 % ≤ 2 %, agreement 0.81 ≥ 0.5, so it passes.
A candidate at NLL 2.10 (a 5 % rise) fails with a reason that names
``eval_gate.max_nll_increase``.

Bounds are compared with a tolerance of ``TOLERANCE`` so that 0.41 − 0.39, which is
0.020000000000000018 in floating point, counts as a drop of 0.02.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from evaluation import metrics
from evaluation.datasets import EvalSet
from evaluation.engine_eval import EvalResult
from evaluation.paired import PairedComparison, compare_paired

if TYPE_CHECKING:
    from controlplane.specs import EvalGate

TOLERANCE = 1e-9
WORST_EXAMPLES = 10


@dataclass(frozen=True)
class GateThresholds:
    """The gate's bounds, as in the endpoint spec's ``eval_gate`` section."""

    metric: str = "exact_match"  # the task metric: "exact_match" or "similarity"
    max_regression: float = 0.05  # largest absolute drop of the task metric (0-1)
    max_nll_increase: float = 0.02  # largest relative rise of mean per-token NLL (0.02 = 2 %)
    min_agreement: float = 0.5  # smallest share of answers identical to the baseline's (0-1)
    significance: float = 0.05  # a drop beyond max_regression is a regression only when p < this (1.0: always)

    def __post_init__(self) -> None:
        metrics.metric_function(self.metric)  # raises KeyError naming the known metrics
        if not 0 < self.significance <= 1:
            raise ValueError(f"significance must be in (0, 1], got {self.significance}")

    @classmethod
    def from_spec(cls, gate: EvalGate) -> GateThresholds:
        return cls(metric=getattr(gate.metric, "value", gate.metric), max_regression=gate.max_regression,
                   max_nll_increase=gate.max_nll_increase, min_agreement=gate.min_agreement,
                   significance=gate.significance)


@dataclass(frozen=True)
class Comparison:
    """One check: what was measured against which bound, and whether it held."""

    name: str  # e.g. "exact_match vs baseline"
    reference: float | None  # the baseline's or serving revision's value (None for agreement)
    candidate: float  # the candidate's value
    measured: float  # what the bound applies to: drop, relative rise or agreement
    bound: float
    passed: bool
    spec_field: str  # the spec field that sets ``bound``, e.g. "eval_gate.max_regression"
    summary: str  # one line for people, e.g. "exact_match vs baseline: 0.41 → 0.40 (drop 0.01 ≤ 0.02)"
    reason: str | None = None  # why it failed and what to change; None when it passed
    paired: PairedComparison | None = None  # task checks: the paired test behind the verdict


@dataclass(frozen=True)
class WorstExample:
    """An example the candidate answers worse than the baseline."""

    id: str
    prompt: str  # the user sentence
    reference: str
    baseline_output: str
    candidate_output: str
    baseline_similarity: float
    candidate_similarity: float

    def to_row(self) -> dict[str, str | float]:
        """A table row: input, reference, baseline, candidate, and both similarities."""
        return {"id": self.id, "input": self.prompt, "reference": self.reference, "baseline": self.baseline_output,
                "candidate": self.candidate_output, "baseline_similarity": round(self.baseline_similarity, 3),
                "candidate_similarity": round(self.candidate_similarity, 3)}


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    checks: list[Comparison]
    reasons: list[str]  # one per failed check, naming the metric, the values and the spec field
    worst_examples: list[WorstExample]

    def summary(self) -> str:
        """Several lines for a person: verdict, every check, then the failures' reasons."""
        lines = ["eval gate " + ("passed" if self.passed else "FAILED")]
        lines += [("  ok   " if c.passed else "  FAIL ") + c.summary for c in self.checks]
        lines += [f"- {reason}" for reason in self.reasons]
        return "\n".join(lines)


# ---- the checks ------------------------------------------------------------------------------

def task_check(metric: str, reference_scores: list[float], candidate_scores: list[float], against: str,
               max_regression: float, significance: float = 1.0) -> Comparison:
    """The task metric's drop is a regression when it exceeds ``max_regression`` and ``p < significance``.

    ``*_scores`` are per-example scores of the same examples in the same order.
    """
    paired = compare_paired(reference_scores, candidate_scores)
    reference, candidate, drop = paired.reference_mean, paired.candidate_mean, paired.drop
    low, high = paired.interval
    beyond = drop > max_regression + TOLERANCE
    real = significance >= 1.0 or paired.p_value < significance
    passed = not (beyond and real)
    evidence = (f"p = {paired.p_value:.3f}, {paired.confidence:.0%} interval of the drop {low:.3f} to {high:.3f}, "
                f"{paired.n} examples")
    if not beyond:
        verdict = f"drop {drop:.3f} ≤ {max_regression:.3f}"
    elif significance >= 1.0:
        verdict = f"drop {drop:.3f} > {max_regression:.3f}"
    elif real:
        verdict = f"drop {drop:.3f} > {max_regression:.3f}, not noise: {evidence}"
    else:
        verdict = f"drop {drop:.3f} > {max_regression:.3f} but within noise: {evidence}"
    summary = f"{metric} vs {against}: {reference:.3f} → {candidate:.3f} ({verdict})"
    reason = None if passed else (
        f"{metric} fell from {reference:.3f} ({against}) to {candidate:.3f} (candidate), a drop of {drop:.3f} "
        f"> {max_regression:.3f} allowed by eval_gate.max_regression, and not noise at eval_gate.significance "
        f"{significance:g} ({paired.test}: {evidence}); keep the {against}, quantize differently, "
        f"or raise eval_gate.max_regression")
    return Comparison(f"{metric} vs {against}", reference, candidate, drop, max_regression, passed,
                      "eval_gate.max_regression", summary, reason, paired)


def nll_check(baseline: float, candidate: float, max_nll_increase: float) -> Comparison:
    """Mean per-token NLL may rise by at most ``max_nll_increase`` relative to the baseline's."""
    name, field = "NLL vs baseline", "eval_gate.max_nll_increase"
    if not math.isfinite(candidate):
        return Comparison(name, baseline, candidate, math.inf, max_nll_increase, False, field,
                          f"{name}: {baseline:.4f} → {candidate} (not finite)",
                          f"the candidate's mean per-token NLL is {candidate}, not a finite number: its outputs "
                          "are numerically broken (e.g. corrupted quantization scales); no eval_gate setting "
                          "accepts it")
    if not math.isfinite(baseline) or baseline <= 0:
        return Comparison(name, baseline, candidate, math.nan, max_nll_increase, False, field,
                          f"{name}: {baseline} → {candidate:.4f} (baseline unusable)",
                          f"the baseline's mean per-token NLL is {baseline}, so a relative rise cannot be "
                          "measured: the baseline evaluation is broken (check the baseline checkpoint and the "
                          "evaluation set's nll_texts)")
    rise = (candidate - baseline) / baseline
    passed = rise <= max_nll_increase + TOLERANCE
    summary = (f"{name}: {baseline:.4f} → {candidate:.4f} "
               f"(rise {rise:.2%} {'≤' if passed else '>'} {max_nll_increase:.2%})")
    reason = None if passed else (
        f"mean per-token NLL rose from {baseline:.4f} (baseline) to {candidate:.4f} (candidate), "
        f"{rise:.2%} > {max_nll_increase:.2%} allowed by eval_gate.max_nll_increase; quantize differently "
        "or raise eval_gate.max_nll_increase")
    return Comparison(name, baseline, candidate, rise, max_nll_increase, passed, field, summary, reason)


def agreement_check(share: float, min_agreement: float) -> Comparison:
    """At least ``min_agreement`` of the candidate's answers must equal the baseline's."""
    passed = share >= min_agreement - TOLERANCE
    summary = f"agreement with baseline: {share:.3f} ({'≥' if passed else '<'} {min_agreement:.3f})"
    reason = None if passed else (
        f"only {share:.3f} of the candidate's greedy answers are identical to the baseline's, fewer than "
        f"{min_agreement:.3f} required by eval_gate.min_agreement; quantize differently or lower "
        "eval_gate.min_agreement")
    return Comparison("agreement with baseline", None, share, share, min_agreement, passed,
                      "eval_gate.min_agreement", summary, reason)


def example_scores(result: EvalResult, metric: str, eval_set: EvalSet) -> list[float]:
    """``metric`` per example of ``eval_set``, in its order (a missing answer scores as the empty one)."""
    score = metrics.metric_function(metric)
    return [score(result.outputs.get(e.id, ""), e.reference) for e in eval_set.examples]


def worst_examples(candidate: EvalResult, baseline: EvalResult, eval_set: EvalSet,
                   limit: int = WORST_EXAMPLES) -> list[WorstExample]:
    """Up to ``limit`` examples the candidate answers worse than the baseline, worst first.

    First those the baseline gets exactly right and the candidate does not, then those whose
    similarity to the reference fell; within each group the largest similarity drop first,
    ties in evaluation-set order.
    """
    ranked = []
    for position, example in enumerate(eval_set.examples):
        base_out, cand_out = baseline.outputs.get(example.id, ""), candidate.outputs.get(example.id, "")
        base_sim = metrics.similarity(base_out, example.reference)
        cand_sim = metrics.similarity(cand_out, example.reference)
        lost_exact = metrics.exact_match(base_out, example.reference) > metrics.exact_match(cand_out, example.reference)
        if not lost_exact and cand_sim >= base_sim:
            continue
        ranked.append(((not lost_exact, cand_sim - base_sim, position), WorstExample(
            example.id, example.prompt, example.reference, base_out, cand_out, base_sim, cand_sim)))
    ranked.sort(key=lambda item: item[0])
    return [example for _, example in ranked[:limit]]


def decide(candidate: EvalResult, baseline: EvalResult, serving: EvalResult | None, thresholds: GateThresholds,
           eval_set: EvalSet) -> GateDecision:
    """Compare the candidate with the baseline (and the serving revision, if any) on ``eval_set``."""
    for result in (baseline, serving):
        if result is not None and result.dataset != candidate.dataset:
            raise ValueError(f"results from different evaluation sets: {candidate.dataset!r} and {result.dataset!r}")
    metric = thresholds.metric
    ids = [e.id for e in eval_set.examples]
    share = metrics.agreement([candidate.outputs.get(i, "") for i in ids], [baseline.outputs.get(i, "") for i in ids])
    candidate_scores = example_scores(candidate, metric, eval_set)
    checks = [
        task_check(metric, example_scores(baseline, metric, eval_set), candidate_scores, "baseline",
                   thresholds.max_regression, thresholds.significance),
        nll_check(baseline.nll, candidate.nll, thresholds.max_nll_increase),
        agreement_check(share, thresholds.min_agreement),
    ]
    if serving is not None:
        checks.append(task_check(metric, example_scores(serving, metric, eval_set), candidate_scores, "serving",
                                 thresholds.max_regression, thresholds.significance))
    reasons = [c.reason for c in checks if c.reason is not None]
    return GateDecision(passed=not reasons, checks=checks, reasons=reasons,
                        worst_examples=worst_examples(candidate, baseline, eval_set))
