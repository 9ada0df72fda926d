"""Evaluating a model on a running OpenAI-compatible engine (vLLM): answers and per-token NLL.

The caller starts the engine (``serving.runtime.process.running_server``); :func:`evaluate`
only talks HTTP to it, so the same code measures the baseline, the quantized candidate and
the serving revision on the engine that will serve them:

- every example is one greedy chat completion (``temperature`` 0) on
  ``/v1/chat/completions``, at most ``concurrency`` in flight;
- every NLL text is one ``/v1/completions`` request with ``prompt_logprobs: 0`` and
  ``max_tokens: 1``, which makes vLLM return the log-probability of each prompt token
  given the ones before it (the first token has none).

vLLM 0.32 answers ``choices[0].prompt_logprobs`` as ``[null, {"<id>": {"logprob": -2.1,
"rank": 7, "decoded_token": " goes"}}, ...]``: one dict per position after the first whose
first entry is the prompt token itself (with ``prompt_logprobs: 0`` no top alternatives are
added). Any other status than 200, or a body of another shape, raises :class:`EngineEvalError`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from evaluation import metrics
from evaluation.datasets import EvalExample, EvalSet

BODY_EXCERPT_CHARS = 500


class EngineEvalError(RuntimeError):
    """The engine did not answer an evaluation request as expected."""

    def __init__(self, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass(frozen=True)
class EvalResult:
    """One model's answers and scores on one evaluation set.

    ``task`` holds every metric of ``evaluation.metrics.METRICS`` (exact_match, similarity),
    so the gate can compare on whichever the spec names; ``nll`` is the mean per-token NLL in
    nats over ``n_nll_tokens`` tokens of the set's held-out text.
    """

    dataset: str
    model: str  # a label for reports: "baseline", "candidate", "serving v3", ...
    outputs: dict[str, str]  # example id → the model's answer, as returned
    task: dict[str, float]  # metric name → mean score over the examples
    nll: float
    n_examples: int
    n_nll_tokens: int
    duration_s: float

    def to_json(self) -> str:
        """JSON text; a non-finite NLL is written as NaN/Infinity, which :meth:`from_json` reads."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EvalResult:
        return cls(**json.loads(text))


def score(eval_set: EvalSet, outputs: dict[str, str], token_logprobs: list[list[float]], *,
          model: str, duration_s: float) -> EvalResult:
    """Score answers (by example id) and prompt log-probabilities (one list per NLL text)."""
    missing = [e.id for e in eval_set.examples if e.id not in outputs]
    if missing:
        raise ValueError(f"no output for {len(missing)} examples, e.g. {missing[:3]}")
    answers = [outputs[e.id] for e in eval_set.examples]
    references = [e.reference for e in eval_set.examples]
    return EvalResult(
        dataset=eval_set.name, model=model, outputs={e.id: outputs[e.id] for e in eval_set.examples},
        task={name: metrics.task_score(name, answers, references) for name in metrics.METRICS},
        nll=metrics.mean_nll(token_logprobs), n_examples=len(eval_set.examples),
        n_nll_tokens=sum(len(t) for t in token_logprobs), duration_s=duration_s)


# ---- request bodies and answers (pure) -------------------------------------------------------

def chat_body(model_name: str, example: EvalExample, max_tokens: int) -> dict[str, Any]:
    return {"model": model_name, "messages": example.messages, "temperature": 0.0, "max_tokens": max_tokens}


def nll_body(model_name: str, text: str) -> dict[str, Any]:
    return {"model": model_name, "prompt": text, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0}


def chat_answer(body: dict) -> str:
    """The assistant's text of a chat completion body ("" when the model said nothing)."""
    try:
        return body["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError) as exc:
        raise EngineEvalError(f"chat completion without choices[0].message: {_excerpt(body)}") from exc


def prompt_token_logprobs(body: dict) -> list[float]:
    """Log-probability of each prompt token after the first, from a vLLM completion body.

    >>> prompt_token_logprobs({"choices": [{"prompt_logprobs": [None,
    ...     {"17": {"logprob": -1.5, "rank": 3, "decoded_token": " go"}},
    ...     {"9": {"logprob": -0.25, "rank": 1, "decoded_token": "."}}]}]})
    [-1.5, -0.25]
    """
    try:
        positions = body["choices"][0]["prompt_logprobs"]
        if not positions or positions[0] is not None:
            raise ValueError("expected null for the first prompt token")
        return [float(next(iter(position.values()))["logprob"]) for position in positions[1:]]
    except (KeyError, IndexError, TypeError, ValueError, StopIteration, AttributeError) as exc:
        raise EngineEvalError(f"completion without vLLM prompt_logprobs ({exc}): {_excerpt(body)}") from exc


def _excerpt(body: Any) -> str:
    text = body if isinstance(body, str) else json.dumps(body)
    return text[:BODY_EXCERPT_CHARS]


# ---- talking to the engine -------------------------------------------------------------------

def _post(client, path: str, body: dict) -> dict:
    import httpx

    try:
        response = client.post(path, json=body)
    except httpx.HTTPError as exc:
        raise EngineEvalError(f"POST {path} failed: {exc!r}") from exc
    if response.status_code != 200:
        raise EngineEvalError(f"POST {path} answered {response.status_code}: {_excerpt(response.text)}",
                              status=response.status_code, body=response.text[:BODY_EXCERPT_CHARS])
    try:
        return response.json()
    except ValueError as exc:
        raise EngineEvalError(f"POST {path} answered 200 without JSON: {_excerpt(response.text)}",
                              status=200, body=response.text[:BODY_EXCERPT_CHARS]) from exc


def _results_in_order(futures: list[Future]) -> list:
    """Each future's result in order; on the first failure the ones not started are cancelled."""
    results = []
    for future in futures:
        try:
            results.append(future.result())
        except BaseException:
            for pending in futures:
                pending.cancel()
            raise
    return results


def evaluate(base_url: str, model_name: str, eval_set: EvalSet, *, concurrency: int = 8, max_tokens: int = 48,
             timeout_s: float = 120, label: str | None = None,
             clock: Callable[[], float] = time.monotonic) -> EvalResult:
    """Run ``eval_set`` against the engine at ``base_url`` serving ``model_name``.

    ``concurrency`` bounds the requests in flight (chat and NLL together); ``timeout_s``
    bounds each request; ``label`` names the model in the result (default ``model_name``).
    Raises :class:`EngineEvalError` on the first request that fails.
    """
    import httpx

    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    started = clock()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(base_url=base_url, timeout=timeout_s, trust_env=False, limits=limits) as client, \
            ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="eval") as pool:
        futures = [pool.submit(lambda e=e: chat_answer(_post(client, "/v1/chat/completions",
                                                              chat_body(model_name, e, max_tokens))))
                   for e in eval_set.examples]
        futures += [pool.submit(lambda t=t: prompt_token_logprobs(_post(client, "/v1/completions",
                                                                         nll_body(model_name, t))))
                    for t in eval_set.nll_texts]
        results = _results_in_order(futures)
    n = len(eval_set.examples)
    outputs = dict(zip((e.id for e in eval_set.examples), results[:n]))
    return score(eval_set, outputs, results[n:], model=label or model_name, duration_s=clock() - started)

