"""What a cost sweep runs and what it measured: pure data, no I/O.

A sweep sends closed-loop load to one replica at every point of a grid of input length ×
output length × concurrency. ``SweepGrid`` says which points and how many requests each;
``RequestSample`` is one measured request; ``SweepPoint`` sums up the requests of one point.

    >>> grid = SweepGrid.quick()
    >>> len(list(grid.points()))  # 2 inputs × 2 outputs × 2 concurrency levels
    8
    >>> next(iter(grid.points()))  # (input tokens, output tokens, concurrency)
    (16, 4, 1)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


class SweepError(ValueError):
    """The sweep's results cannot support what was asked of them; the message says what to change."""


def nearest_rank_percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile: the ⌈q·n⌉-th smallest of n values (nan when there are none).

    Of 200 values q=0.99 is the 198th smallest; of 8 values it is the largest, and q=0.5
    is the 4th smallest. It is always a measured value, never an interpolation.

        >>> nearest_rank_percentile([40.0, 10.0, 30.0, 20.0], 0.5)
        20.0
    """
    if not 0 < q <= 1:
        raise ValueError(f"percentile q must be in (0, 1], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = math.ceil(q * len(ordered) - 1e-9)  # the epsilon keeps 0.99 × 100 at rank 99
    return float(ordered[min(len(ordered), max(1, rank)) - 1])


def number_or_none(value: float | None) -> float | None:
    """JSON has no nan or infinity: a missing measurement travels as null."""
    return None if value is None or not math.isfinite(value) else float(value)


def number_or_nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


@dataclass(frozen=True)
class SweepGrid:
    """The points of a sweep and how long each may take.

    ``requests_per_point`` is the floor on requests sent at a point; ``requests_for(c)``
    sends at least two rounds of the c closed-loop workers. ``max_point_s`` is a point's time
    budget: no new request is sent at a point after that many seconds (requests in flight
    finish), so one slow point cannot stretch the sweep.
    """

    input_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    concurrency: tuple[int, ...]
    requests_per_point: int
    max_point_s: float

    def __post_init__(self) -> None:
        for name in ("input_tokens", "output_tokens", "concurrency"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"SweepGrid.{name} is empty; a sweep needs at least one value")
            if len(set(values)) != len(values):
                raise ValueError(f"SweepGrid.{name} repeats a value: {values}")
        if min(self.input_tokens) < 0 or min(self.output_tokens) < 0:
            raise ValueError("token counts cannot be negative")
        if min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be at least 1, got {self.concurrency}")
        if self.requests_per_point < 1:
            raise ValueError(f"requests_per_point must be at least 1, got {self.requests_per_point}")
        if not self.max_point_s > 0:
            raise ValueError(f"max_point_s must be positive, got {self.max_point_s}")

    @classmethod
    def quick(cls) -> SweepGrid:
        """The tiny LLM grid of the tests: 2 × 2 shapes at concurrency 1 and 4, 8 requests each."""
        return cls(input_tokens=(16, 64), output_tokens=(4, 16), concurrency=(1, 4),
                   requests_per_point=8, max_point_s=5.0)

    @classmethod
    def default(cls) -> SweepGrid:
        """SmolLM2 on 2 CPU cores: 3 × 2 shapes × 4 levels = 24 points, at most 9 s each.

        With every request taking 1 s, ``estimated_duration_s(1.0)`` is 84 s.
        """
        return cls(input_tokens=(32, 128, 384), output_tokens=(16, 48), concurrency=(1, 4, 8, 16),
                   requests_per_point=8, max_point_s=9.0)

    @classmethod
    def classic(cls, concurrency: tuple[int, ...] = (1, 4, 16, 32)) -> SweepGrid:
        """A non-LLM model: no token axes (inputs and outputs are (0,)), concurrency only."""
        return cls(input_tokens=(0,), output_tokens=(0,), concurrency=tuple(concurrency),
                   requests_per_point=16, max_point_s=5.0)

    def points(self) -> Iterator[tuple[int, int, int]]:
        """Every (input tokens, output tokens, concurrency), lowest concurrency first."""
        for concurrency in self.concurrency:
            for input_tokens in self.input_tokens:
                for output_tokens in self.output_tokens:
                    yield input_tokens, output_tokens, concurrency

    @property
    def n_points(self) -> int:
        return len(self.input_tokens) * len(self.output_tokens) * len(self.concurrency)

    def requests_for(self, concurrency: int) -> int:
        """Requests to send at a point: ``max(requests_per_point, 2 × concurrency)``.

        Two rounds of the closed-loop workers at least, so a level's p99 is never one wave.
        For the default grid: 8 at concurrency 1 and 4, 16 at 8, 32 at 16.
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        return max(self.requests_per_point, 2 * concurrency)

    def estimated_duration_s(self, seconds_per_request_guess: float) -> float:
        """The sweep's wall time if every request took ``seconds_per_request_guess``.

        At concurrency c the n requests of a point go out in ⌈n / c⌉ waves; the time budget
        lets ⌈max_point_s / guess⌉ waves start. Default grid, 2 s a request: at concurrency 1,
        min(8, ⌈9 / 2⌉) = 5 waves = 10 s per point; at 4, 8 and 16, 2 waves = 4 s per point;
        6 × 10 + 18 × 4 = 132 s.
        """
        if not seconds_per_request_guess > 0:
            raise ValueError(f"seconds_per_request_guess must be positive, got {seconds_per_request_guess}")
        waves_allowed = math.ceil(self.max_point_s / seconds_per_request_guess)
        total_s = 0.0
        for _, _, concurrency in self.points():
            waves = math.ceil(self.requests_for(concurrency) / concurrency)
            total_s += min(waves, waves_allowed) * seconds_per_request_guess
        return total_s


@dataclass(frozen=True)
class RequestSample:
    """One measured request: its token counts, the concurrency it ran at, and what it took.

    ``latency_ms`` runs from send to last byte; ``ttft_ms`` to the first streamed token
    (None when the answer was not streamed). A failed request (``ok=False``) keeps whatever
    latency was measured, but no fit or percentile uses it.
    """

    input_tokens: int
    output_tokens: int
    concurrency: int
    latency_ms: float
    ttft_ms: float | None
    ok: bool

    def __post_init__(self) -> None:
        if self.input_tokens < 0 or self.output_tokens < 0:
            raise ValueError(f"token counts cannot be negative: {self.input_tokens}, {self.output_tokens}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.input_tokens, self.output_tokens

    def to_json(self) -> dict:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "concurrency": self.concurrency, "latency_ms": number_or_none(self.latency_ms),
                "ttft_ms": number_or_none(self.ttft_ms), "ok": self.ok}

    @classmethod
    def from_json(cls, data: dict) -> RequestSample:
        return cls(input_tokens=int(data["input_tokens"]), output_tokens=int(data["output_tokens"]),
                   concurrency=int(data["concurrency"]), latency_ms=number_or_nan(data["latency_ms"]),
                   ttft_ms=None if data.get("ttft_ms") is None else float(data["ttft_ms"]), ok=bool(data["ok"]))


@dataclass(frozen=True)
class SweepPoint:
    """The requests of one (input, output, concurrency) point, summed up.

    Latency figures cover the successful requests only (nan when none succeeded);
    ``p99_ttft_ms`` is None when no request streamed. Throughput counts successful requests
    and their output tokens over the point's wall time.
    """

    input_tokens: int
    output_tokens: int
    concurrency: int
    n_ok: int
    n_failed: int
    mean_latency_ms: float
    p50_latency_ms: float
    p99_latency_ms: float
    p99_ttft_ms: float | None
    throughput_rps: float
    output_tokens_per_s: float

    @property
    def shape(self) -> tuple[int, int]:
        return self.input_tokens, self.output_tokens

    @classmethod
    def aggregate(cls, samples: Sequence[RequestSample], wall_s: float, *,
                  input_tokens: int | None = None, output_tokens: int | None = None) -> SweepPoint:
        """Sum up one point's requests, sent over ``wall_s`` seconds.

        The samples must share one concurrency. The point's shape is the samples' common
        shape, or the grid's nominal shape when given (samples that record the tokens the
        server counted may differ from it by a few tokens).

        Three requests of 100, 200 and 300 ms and one failure over 2 s: mean 200 ms, p50 200 ms,
        p99 300 ms, 1.5 requests per second.
        """
        if not samples:
            raise ValueError("a sweep point needs at least one request sample")
        if not wall_s > 0:
            raise ValueError(f"wall_s must be positive, got {wall_s}")
        levels = {s.concurrency for s in samples}
        if len(levels) != 1:
            raise ValueError(f"one sweep point holds one concurrency level, got {sorted(levels)}")
        shapes = {s.shape for s in samples}
        if (input_tokens is None or output_tokens is None) and len(shapes) != 1:
            raise ValueError(f"the samples have {len(shapes)} shapes; pass the point's nominal "
                             "input_tokens and output_tokens")
        shape_input, shape_output = next(iter(shapes))
        ok = [s for s in samples if s.ok]
        latencies_ms = [s.latency_ms for s in ok]
        ttfts_ms = [s.ttft_ms for s in ok if s.ttft_ms is not None]
        return cls(
            input_tokens=shape_input if input_tokens is None else input_tokens,
            output_tokens=shape_output if output_tokens is None else output_tokens,
            concurrency=levels.pop(), n_ok=len(ok), n_failed=len(samples) - len(ok),
            mean_latency_ms=sum(latencies_ms) / len(ok) if ok else math.nan,
            p50_latency_ms=nearest_rank_percentile(latencies_ms, 0.5),
            p99_latency_ms=nearest_rank_percentile(latencies_ms, 0.99),
            p99_ttft_ms=nearest_rank_percentile(ttfts_ms, 0.99) if ttfts_ms else None,
            throughput_rps=len(ok) / wall_s,
            output_tokens_per_s=sum(s.output_tokens for s in ok) / wall_s,
        )

    def to_json(self) -> dict:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "concurrency": self.concurrency, "n_ok": self.n_ok, "n_failed": self.n_failed,
                "mean_latency_ms": number_or_none(self.mean_latency_ms),
                "p50_latency_ms": number_or_none(self.p50_latency_ms),
                "p99_latency_ms": number_or_none(self.p99_latency_ms),
                "p99_ttft_ms": number_or_none(self.p99_ttft_ms),
                "throughput_rps": self.throughput_rps, "output_tokens_per_s": self.output_tokens_per_s}

    @classmethod
    def from_json(cls, data: dict) -> SweepPoint:
        return cls(input_tokens=int(data["input_tokens"]), output_tokens=int(data["output_tokens"]),
                   concurrency=int(data["concurrency"]), n_ok=int(data["n_ok"]), n_failed=int(data["n_failed"]),
                   mean_latency_ms=number_or_nan(data["mean_latency_ms"]),
                   p50_latency_ms=number_or_nan(data["p50_latency_ms"]),
                   p99_latency_ms=number_or_nan(data["p99_latency_ms"]),
                   p99_ttft_ms=None if data.get("p99_ttft_ms") is None else float(data["p99_ttft_ms"]),
                   throughput_rps=float(data["throughput_rps"]),
                   output_tokens_per_s=float(data["output_tokens_per_s"]))
