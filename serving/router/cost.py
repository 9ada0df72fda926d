"""What a request will cost, in model units, before it is sent: the router's side of the cost model.

The ``cost_model`` asset fits ``latency_ms(i, o) = α·i + β·o + γ`` at a replica's target
concurrency c; one model unit is one millisecond of replica time there, so a request costs
``(α·i + β·o + γ) / c`` units (``costmodel.fit``). The router does not tokenize: it
estimates ``i`` from the prompt's characters (4 per token, the usual figure for English
BPE vocabularies; a list of token ids counts exactly) and takes ``o`` from ``max_tokens``
(or ``max_completion_tokens``), else from the mean output the endpoint's answers reported
lately. Without a profile for the endpoint's serving revision on this hardware, every
request costs one unit, which is balancing on request counts.

Worked example: α = 0.5 ms/token, β = 20 ms/token, γ = 30 ms at c = 4; a 400-character
prompt (≈ 100 tokens) with ``max_tokens: 10`` costs (50 + 200 + 30) / 4 = 70 units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CHARS_PER_TOKEN = 4
DEFAULT_OUTPUT_TOKENS = 64  # before any answer has reported its length
EWMA_WEIGHT = 0.1


@dataclass(frozen=True)
class RouteCost:
    """The coefficients of one endpoint's serving revision at its target concurrency."""

    alpha_ms_per_input_token: float
    beta_ms_per_output_token: float
    gamma_ms: float
    concurrency: int

    def latency_ms(self, input_tokens: float, output_tokens: float) -> float:
        return self.alpha_ms_per_input_token * input_tokens + self.beta_ms_per_output_token * output_tokens + \
            self.gamma_ms

    def units(self, input_tokens: float, output_tokens: float) -> float:
        return max(self.latency_ms(input_tokens, output_tokens) / self.concurrency, 1e-3)

    @classmethod
    def from_profile(cls, model: dict) -> RouteCost | None:
        """From ``CostModel.to_json()``: the coefficients of its target concurrency level."""
        try:
            target = int(model["target_concurrency"])
            level = next(level for level in model["levels"] if int(level["concurrency"]) == target)
            return cls(float(level["alpha_ms_per_input_token"]), float(level["beta_ms_per_output_token"]),
                       float(level["gamma_ms"]), int(model["target_concurrency"]))
        except (KeyError, TypeError, ValueError, StopIteration):
            return None


def _text_chars(value) -> float:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_chars(item) for item in value)
    if isinstance(value, dict):
        return _text_chars(value.get("content", "")) + _text_chars(value.get("text", ""))
    return 0


def input_tokens(payload: dict) -> float:
    """Estimated prompt tokens of an OpenAI-style body (``prompt`` or ``messages``)."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return float(len(prompt))  # token ids: exact
    chars = _text_chars(prompt) + _text_chars(payload.get("messages"))
    return math.ceil(chars / CHARS_PER_TOKEN)


def output_tokens(payload: dict, mean_output: float | None) -> float:
    for key in ("max_tokens", "max_completion_tokens"):
        value = payload.get(key)
        if isinstance(value, int) and value > 0:
            return float(value)
    return mean_output if mean_output else float(DEFAULT_OUTPUT_TOKENS)


def request_units(payload: dict | None, cost: RouteCost | None, mean_output: float | None) -> float:
    """Model units of one request: 1 without a profile; γ/c for a classic model (no payload)."""
    if cost is None:
        return 1.0
    if not isinstance(payload, dict):
        return cost.units(0, 0)
    return cost.units(input_tokens(payload), output_tokens(payload, mean_output))


def updated_mean(previous: float | None, observed: float) -> float:
    """Exponentially weighted mean of reported output lengths (weight 0.1 on the newest)."""
    return observed if previous is None else (1 - EWMA_WEIGHT) * previous + EWMA_WEIGHT * observed
