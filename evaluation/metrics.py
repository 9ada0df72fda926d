"""Scoring model answers and log-probabilities: pure functions, no I/O.

A chat model's answer is compared with the reference after :func:`normalize` (first line,
whitespace collapsed, surrounding quotes removed), so "  \\"She goes home.\\"\\nHope this
helps!" counts as "She goes home.". Case and punctuation are kept: a capitalization fix is
the whole point of some examples.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Sequence

_QUOTE_PAIRS = (('"', '"'), ("'", "'"), ("\u201c", "\u201d"), ("\u2018", "\u2019"), ("`", "`"))


def normalize(text: str) -> str:
    """The first non-empty line of ``text``, whitespace collapsed, surrounding quotes removed.

    >>> normalize('  "She goes   home."\\nI corrected the verb.')
    'She goes home.'
    >>> normalize("\\n\\n\u201cWe have an egg.\u201d ")
    'We have an egg.'
    """
    lines = [line for line in text.strip().splitlines() if line.strip()]
    first = re.sub(r"\s+", " ", lines[0]).strip() if lines else ""
    changed = True
    while changed and len(first) >= 2:
        changed = False
        for opening, closing in _QUOTE_PAIRS:
            if first.startswith(opening) and first.endswith(closing):
                first, changed = first[1:-1].strip(), True
    return first


def exact_match(output: str, reference: str) -> float:
    """1.0 when the normalized answer equals the normalized reference, else 0.0.

    >>> exact_match("She goes home.", "She goes home."), exact_match("she goes home.", "She goes home.")
    (1.0, 0.0)
    """
    return 1.0 if normalize(output) == normalize(reference) else 0.0


def similarity(output: str, reference: str) -> float:
    """difflib's SequenceMatcher ratio of the normalized texts: 2·matches / total length, in [0, 1].

    Worked example: "She go home." vs "She goes home." share 12 characters of 12 + 14,
    so 2 × 12 / 26 ≈ 0.923.

    >>> round(similarity("She go home.", "She goes home."), 3)
    0.923
    """
    return difflib.SequenceMatcher(None, normalize(output), normalize(reference), autojunk=False).ratio()


METRICS: dict[str, Callable[[str, str], float]] = {"exact_match": exact_match, "similarity": similarity}


def metric_function(metric: str) -> Callable[[str, str], float]:
    """The per-example function of ``metric`` ("exact_match" or "similarity", or an ``EvalMetric``)."""
    name = getattr(metric, "value", metric)
    if name not in METRICS:
        raise KeyError(f"unknown metric {name!r}; known: {', '.join(sorted(METRICS))}")
    return METRICS[name]


def task_score(metric: str, outputs: Sequence[str], references: Sequence[str]) -> float:
    """Mean of ``metric`` over (output, reference) pairs.

    >>> task_score("exact_match", ["She goes home.", "He go."], ["She goes home.", "He goes."])
    0.5
    """
    if len(outputs) != len(references):
        raise ValueError(f"{len(outputs)} outputs for {len(references)} references")
    if not outputs:
        raise ValueError("no outputs to score")
    score = metric_function(metric)
    return sum(score(o, r) for o, r in zip(outputs, references)) / len(outputs)


def agreement(outputs_a: Sequence[str], outputs_b: Sequence[str]) -> float:
    """Share of positions where the two models' normalized answers are identical.

    >>> agreement(["A.", "B.", "C.", "D."], ["A.", "B.", "x", "D.\\nmore"])
    0.75
    """
    if len(outputs_a) != len(outputs_b):
        raise ValueError(f"{len(outputs_a)} outputs against {len(outputs_b)}")
    if not outputs_a:
        raise ValueError("no outputs to compare")
    return sum(normalize(a) == normalize(b) for a, b in zip(outputs_a, outputs_b)) / len(outputs_a)


def mean_nll(token_logprobs: Sequence[Sequence[float]]) -> float:
    """Mean negative log-probability per token over all texts (nats); perplexity = exp of it.

    Every token weighs the same, so long texts count more than short ones. A NaN or −inf
    log-probability (broken weights) makes the result NaN or inf, which the gate rejects.
    Worked example: texts with log-probs [−1, −2] and [−3] → (1 + 2 + 3) / 3 = 2.0 nats,
    perplexity e² ≈ 7.39.

    >>> mean_nll([[-1.0, -2.0], [-3.0]])
    2.0
    """
    count = sum(len(text) for text in token_logprobs)
    if count == 0:
        raise ValueError("no token log-probabilities to average")
    return -math.fsum(lp for text in token_logprobs for lp in text) / count
