"""Is a candidate's drop on an evaluation set real, or noise? Paired tests on per-example scores.

The gate scores the same examples with two models (baseline or serving revision, and the
candidate), so the comparison is paired: only the examples where the two differ carry
information. For a 0/1 metric (exact match) that is McNemar's exact test on the discordant
pairs; for a graded metric (similarity) a sign-flip randomization test on the per-example
differences. Both are one-sided: the question is only whether the candidate is worse. The
interval is a percentile bootstrap of the mean difference over examples.

Worked example: 80 examples, the baseline right and the candidate wrong on 6 of them, the
reverse on 1. The drop is (6 − 1) / 80 = 0.0625; if quantization did no harm, each of the 7
changed answers would be as likely to go either way, so the chance of 6 or more of 7 going
against the candidate is (C(7,6) + C(7,7)) / 2⁷ = 8/128 = 0.0625: not unlikely enough at
5 %, so the gate does not call it a regression however large 0.0625 looks.

>>> result = compare_paired([1.0] * 6 + [0.0] + [1.0] * 73, [0.0] * 6 + [1.0] + [1.0] * 73)
>>> result.drop, result.p_value, (result.worse, result.better)
(0.0625, 0.0625, (6, 1))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_RESAMPLES = 4000
DEFAULT_SEED = 20261201  # fixed: the same scores always give the same interval and p-value


@dataclass(frozen=True)
class PairedComparison:
    """A reference model against a candidate on the same ``n`` examples."""

    n: int
    reference_mean: float
    candidate_mean: float
    drop: float  # reference − candidate (positive: the candidate is worse)
    interval: tuple[float, float]  # bootstrap interval of ``drop`` at ``confidence``
    confidence: float
    p_value: float  # one-sided: the chance of a drop at least this large if the models were equally good
    test: str  # which test gave ``p_value``
    worse: int  # examples the candidate scores lower on
    better: int  # examples the candidate scores higher on

    def to_json(self) -> dict:
        return {"n": self.n, "reference": round(self.reference_mean, 4), "candidate": round(self.candidate_mean, 4),
                "drop": round(self.drop, 4), "interval": [round(v, 4) for v in self.interval],
                "confidence": self.confidence, "p_value": round(self.p_value, 4), "test": self.test,
                "worse": self.worse, "better": self.better}


def mcnemar_one_sided(worse: int, better: int) -> float:
    """P(at least ``worse`` of ``worse + better`` discordant pairs against the candidate | no difference).

    >>> mcnemar_one_sided(6, 1), mcnemar_one_sided(0, 0), round(mcnemar_one_sided(30, 10), 4)
    (0.0625, 1.0, 0.0011)
    """
    total = worse + better
    if total == 0:
        return 1.0
    return math.fsum(math.comb(total, k) for k in range(worse, total + 1)) / 2 ** total


def sign_flip_one_sided(differences: np.ndarray, resamples: int, rng: np.random.Generator) -> float:
    """Randomization p-value for mean(``differences``) > 0: each difference's sign flipped at random.

    Exact enumeration when there are at most 16 non-zero differences, else ``resamples`` draws
    (with the +1 correction, so it is never 0).
    """
    nonzero = differences[differences != 0]
    if nonzero.size == 0:
        return 1.0
    observed = nonzero.sum()
    if nonzero.size <= 16:
        signs = ((np.arange(2 ** nonzero.size)[:, None] >> np.arange(nonzero.size)) & 1) * 2 - 1
        sums = (signs * np.abs(nonzero)).sum(axis=1)
        return float(np.mean(sums >= observed - 1e-12))
    signs = rng.choice((-1.0, 1.0), size=(resamples, nonzero.size))
    sums = (signs * np.abs(nonzero)).sum(axis=1)
    return float((1 + np.sum(sums >= observed - 1e-12)) / (1 + resamples))


def compare_paired(reference: Sequence[float], candidate: Sequence[float], *, confidence: float = 0.95,
                   resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> PairedComparison:
    """Drop, bootstrap interval and one-sided p-value of ``candidate`` against ``reference``."""
    ref, cand = np.asarray(reference, dtype=float), np.asarray(candidate, dtype=float)
    if ref.shape != cand.shape or ref.ndim != 1:
        raise ValueError(f"paired scores must be two lists of one length, got {ref.shape} and {cand.shape}")
    if ref.size == 0:
        raise ValueError("no examples to compare")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    differences = ref - cand
    worse, better = int(np.sum(differences > 0)), int(np.sum(differences < 0))
    binary = np.isin(ref, (0.0, 1.0)).all() and np.isin(cand, (0.0, 1.0)).all()
    if binary:
        p_value, test = mcnemar_one_sided(worse, better), f"McNemar exact, {worse} worse / {better} better"
    else:
        p_value = sign_flip_one_sided(differences, resamples, rng)
        test = f"sign-flip randomization, {worse} worse / {better} better"
    means = differences[rng.integers(0, ref.size, size=(resamples, ref.size))].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return PairedComparison(n=int(ref.size), reference_mean=float(ref.mean()), candidate_mean=float(cand.mean()),
                            drop=float(differences.mean()), interval=(float(low), float(high)),
                            confidence=confidence, p_value=float(p_value), test=test, worse=worse, better=better)
