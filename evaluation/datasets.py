"""Evaluation sets by name: chat prompts with references, and held-out text for NLL.

An :class:`EvalSet` is what the eval gate runs a model on. Each :class:`EvalExample` is a
complete OpenAI chat request body's ``messages`` (instruction, few-shot turns, the sentence)
with the reference answer; ``nll_texts`` is plain text whose per-token negative
log-likelihood the gate measures.

Known sets:

- ``gec-heldout`` (the default, what ``EvalGate.dataset = None`` means): the held-out part of
  ``evaluation.gec_data``. Its few-shot turns come from the development part, so no held-out
  sentence ever appears in a prompt; ``nll_texts`` are the held-out corrected sentences.
- ``gec-dev``: the development part without the few-shot pairs, for benchmarks and prompt
  work that must not look at the held-out part.

Worked example: ``eval_set().examples[0].messages`` is 8 messages: the system instruction,
3 × (user sentence, assistant correction) from the development part, and the user sentence
to correct, e.g. "the manager carries the boxes every morning."; its ``reference`` is the
correction "The manager carries the boxes every morning.".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from evaluation import gec_data
from evaluation.gec_data import GecPair

DEFAULT_EVAL_SET = "gec-heldout"
# Short enough for SmolLM2-135M-Instruct to follow; the few-shot turns carry the format.
GEC_INSTRUCTION = "Correct the grammar of the sentence. Answer with the corrected sentence only."
# One development pair of each of these error kinds shows the model the answer format.
FEW_SHOT_KINDS = ("agreement", "article", "capitalization")


@dataclass(frozen=True)
class EvalExample:
    """One chat request and the answer it should get."""

    id: str  # stable across runs and set growth: derived from the prompt sentence
    messages: list[dict]  # OpenAI chat messages, ending with the user turn to answer
    reference: str  # the expected answer
    kind: str  # the error kind (for per-kind breakdowns)

    @property
    def prompt(self) -> str:
        """The content of the last user message: the sentence the model is asked about."""
        return self.messages[-1]["content"]


@dataclass(frozen=True)
class EvalSet:
    name: str
    examples: list[EvalExample]
    nll_texts: list[str]  # held-out text whose mean per-token NLL is measured

    @property
    def fingerprint(self) -> str:
        """SHA-256 over the examples and NLL texts: a stored result of another version of the set never counts."""
        digest = hashlib.sha256(self.name.encode())
        for example in self.examples:
            digest.update(f"\n{example.id}\t{example.reference}\t{example.messages!r}".encode())
        for text in self.nll_texts:
            digest.update(f"\n{text}".encode())
        return digest.hexdigest()

    @property
    def references(self) -> dict[str, str]:
        """Example id → reference answer."""
        return {example.id: example.reference for example in self.examples}

    def example(self, example_id: str) -> EvalExample:
        return next(e for e in self.examples if e.id == example_id)

    def sample(self, max_examples: int | None) -> EvalSet:
        """At most ``max_examples`` examples, evenly spaced through the set so that its kinds stay
        mixed, and as many NLL texts, spaced the same way; the whole set when it is no larger
        (or ``max_examples`` is None). A sample is named after its size, and its fingerprint is
        its own, so a stored result of the whole set never stands for it.

        >>> whole = EvalSet("s", [EvalExample(f"e{i}", [], f"r{i}", "k") for i in range(10)],
        ...                 [f"t{i}" for i in range(10)])
        >>> part = whole.sample(4)
        >>> part.name, [e.id for e in part.examples], part.nll_texts
        ('s-4of10', ['e0', 'e2', 'e5', 'e7'], ['t0', 't2', 't5', 't7'])
        >>> whole.sample(10) is whole and whole.sample(None) is whole
        True
        """
        if max_examples is None or max_examples >= len(self.examples):
            return self
        if max_examples < 1:
            raise ValueError(f"max_examples must be at least 1, got {max_examples}")
        return EvalSet(name=f"{self.name}-{max_examples}of{len(self.examples)}",
                       examples=_evenly_spaced(self.examples, max_examples),
                       nll_texts=_evenly_spaced(self.nll_texts, max_examples))


def _evenly_spaced(items: list, count: int) -> list:
    """``count`` of ``items`` (all when there are no more), from the first, evenly spaced."""
    if count >= len(items):
        return list(items)
    return [items[i * len(items) // count] for i in range(count)]


def example_id(source: str, prefix: str = "gec") -> str:
    """A short stable id for a sentence: ``prefix`` + the first 10 hex digits of SHA-256(source)."""
    return f"{prefix}-{hashlib.sha256(source.encode()).hexdigest()[:10]}"


def few_shot_pairs(development: list[GecPair], kinds: tuple[str, ...] = FEW_SHOT_KINDS) -> list[GecPair]:
    """The first development pair of each kind in ``kinds``, in that order (a fixed choice)."""
    chosen = []
    for kind in kinds:
        match = next((p for p in development if p.kind == kind), None)
        if match is None:
            raise ValueError(f"the development split has no {kind!r} pair for the few-shot prompt")
        chosen.append(match)
    return chosen


def gec_messages(source: str, shots: list[GecPair], instruction: str = GEC_INSTRUCTION) -> list[dict]:
    """System instruction, one (user, assistant) turn per few-shot pair, then ``source``."""
    messages: list[dict] = [{"role": "system", "content": instruction}]
    for shot in shots:
        messages += [{"role": "user", "content": shot.source}, {"role": "assistant", "content": shot.target}]
    return [*messages, {"role": "user", "content": source}]


def gec_eval_set(name: str, evaluated: list[GecPair], shots: list[GecPair]) -> EvalSet:
    examples = [EvalExample(id=example_id(p.source), messages=gec_messages(p.source, shots),
                            reference=p.target, kind=p.kind) for p in evaluated]
    return EvalSet(name=name, examples=examples, nll_texts=[p.target for p in evaluated])


def _gec_heldout() -> EvalSet:
    development, held_out = gec_data.split(gec_data.pairs())
    return gec_eval_set("gec-heldout", held_out, few_shot_pairs(development))


def _gec_dev() -> EvalSet:
    development, _ = gec_data.split(gec_data.pairs())
    shots = few_shot_pairs(development)
    return gec_eval_set("gec-dev", [p for p in development if p not in shots], shots)


_EVAL_SETS: dict[str, Callable[[], EvalSet]] = {"gec-heldout": _gec_heldout, "gec-dev": _gec_dev}


def known_eval_sets() -> list[str]:
    return sorted(_EVAL_SETS)


def eval_set(name: str | None = None) -> EvalSet:
    """The evaluation set called ``name``; None means ``gec-heldout``.

    >>> eval_set().name
    'gec-heldout'
    >>> eval_set("squad")
    Traceback (most recent call last):
    KeyError: "unknown evaluation set 'squad'; known: gec-dev, gec-heldout"
    """
    name = DEFAULT_EVAL_SET if name is None else name
    if name not in _EVAL_SETS:
        raise KeyError(f"unknown evaluation set {name!r}; known: {', '.join(known_eval_sets())}")
    return _EVAL_SETS[name]()
