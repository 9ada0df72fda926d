"""A closed-loop HTTP load generator (aiohttp) shared by the benchmarks.

``concurrency`` workers each send a request, wait for the whole answer, and send the next,
for ``duration_s`` seconds after ``warmup_s`` seconds whose requests are not counted.
Latency is measured per request from send to last byte.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp


@dataclass
class LoadResult:
    concurrency: int
    duration_s: float
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    @property
    def completed(self) -> int:
        return len(self.latencies_s)

    @property
    def throughput_rps(self) -> float:
        return self.completed / self.duration_s if self.duration_s else 0.0

    def percentile_ms(self, q: float) -> float:
        """Nearest-rank percentile: q=0.99 of 200 samples is the 198th smallest."""
        if not self.latencies_s:
            return float("nan")
        ordered = sorted(self.latencies_s)
        index = min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))
        return ordered[index] * 1000

    def record(self, outcome: "Outcome", sent: float, done: float) -> None:
        if outcome.ok:
            self.latencies_s.append(done - sent)
        else:
            self.errors += 1

    def summary(self) -> dict:
        return {"concurrency": self.concurrency, "completed": self.completed, "errors": self.errors,
                "throughput_rps": round(self.throughput_rps, 2), "p50_ms": round(self.percentile_ms(0.5), 2),
                "p99_ms": round(self.percentile_ms(0.99), 2)}


@dataclass
class Outcome:
    """What one request came back with."""

    ok: bool
    error: str | None = None  # a sample for LoadResult.error_samples
    tokens: int = 0  # OpenAI answers: output tokens
    first_choice_at: float | None = None  # streaming: perf_counter time of the first choice


Exchange = Callable[[aiohttp.ClientSession, str, dict], Awaitable[Outcome]]


async def _plain_exchange(session: aiohttp.ClientSession, url: str, body: dict) -> Outcome:
    async with session.post(url, json=body) as response:
        content = await response.read()
        if response.status < 400:
            return Outcome(ok=True)
        return Outcome(ok=False, error=f"{response.status}: {content[:200].decode(errors='replace')}")


async def _drive(url: str, make_body: Callable[[int], dict], concurrency: int, duration_s: float, warmup_s: float,
                 headers: dict[str, str], result: LoadResult, exchange: Exchange) -> LoadResult:
    """The closed loop itself: ``concurrency`` workers, each sending its next request when the
    last one is answered; only requests sent after the warm-up and answered before the end count."""
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        async def worker(worker_id: int) -> None:
            n = 0
            while (sent := time.perf_counter()) < stop_at:
                try:
                    outcome = await exchange(session, url, make_body(worker_id * 1_000_000 + n))
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                    outcome = Outcome(ok=False, error=repr(exc))
                done = time.perf_counter()
                n += 1
                if outcome.error and len(result.error_samples) < 5:
                    result.error_samples.append(outcome.error)
                if sent >= measure_from and done <= stop_at:
                    result.record(outcome, sent, done)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return result


def closed_loop(url: str, make_body: Callable[[int], dict], *, concurrency: int, duration_s: float,
                warmup_s: float = 1.0, headers: dict[str, str] | None = None) -> LoadResult:
    """Run one closed-loop load level and return its latencies."""
    result = LoadResult(concurrency=concurrency, duration_s=duration_s)
    return asyncio.run(_drive(url, make_body, concurrency, duration_s, warmup_s, headers or {}, result,
                              _plain_exchange))


# ---- OpenAI-style completions: output tokens and time to first token -------------------------

@dataclass
class TokenLoadResult(LoadResult):
    """A :class:`LoadResult` that also counts output tokens and, when streaming, time to first token."""

    output_tokens: int = 0  # summed ``usage.completion_tokens`` of the measured requests
    ttfts_s: list[float] = field(default_factory=list)  # streaming only: send → first streamed choice

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s else 0.0

    def ttft_percentile_ms(self, q: float) -> float:
        """Nearest-rank percentile of the time to first token, as ``percentile_ms``."""
        if not self.ttfts_s:
            return float("nan")
        ordered = sorted(self.ttfts_s)
        return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))] * 1000

    def record(self, outcome: Outcome, sent: float, done: float) -> None:
        super().record(outcome, sent, done)
        if outcome.ok:
            self.output_tokens += outcome.tokens
            if outcome.first_choice_at is not None:
                self.ttfts_s.append(outcome.first_choice_at - sent)

    def summary(self) -> dict:
        result = super().summary() | {"output_tokens_per_s": round(self.output_tokens_per_s, 1)}
        if self.ttfts_s:
            result |= {"ttft_p50_ms": round(self.ttft_percentile_ms(0.5), 2),
                       "ttft_p99_ms": round(self.ttft_percentile_ms(0.99), 2)}
        return result


async def _read_completion(response: aiohttp.ClientResponse, stream: bool) -> tuple[int, float | None]:
    """Output tokens of one answer and, when streaming, the perf_counter time of its first choice."""
    import json

    if not stream:
        body = await response.json(content_type=None)
        return int((body.get("usage") or {}).get("completion_tokens") or 0), None
    tokens, usage_tokens, first_choice_at = 0, None, None
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if chunk.get("usage"):
            usage_tokens = chunk["usage"].get("completion_tokens")
        choices = chunk.get("choices") or []
        if choices and first_choice_at is None:
            # vLLM streams a chunk as soon as the first token is out, even when that token's
            # text is still empty (a special token, or half of a multi-byte character).
            first_choice_at = time.perf_counter()
        tokens += sum(1 for c in choices if c.get("text") or (c.get("delta") or {}).get("content"))
    return (usage_tokens if usage_tokens is not None else tokens), first_choice_at


def _openai_exchange(stream: bool) -> Exchange:
    async def exchange(session: aiohttp.ClientSession, url: str, body: dict) -> Outcome:
        if stream:
            body = body | {"stream": True, "stream_options": {"include_usage": True}}
        async with session.post(url, json=body) as response:
            if response.status >= 400:
                return Outcome(ok=False, error=f"{response.status}: {(await response.text())[:200]}")
            tokens, first_choice_at = await _read_completion(response, stream)
            return Outcome(ok=True, tokens=tokens, first_choice_at=first_choice_at)

    return exchange


def closed_loop_openai(url: str, make_body: Callable[[int], dict], *, concurrency: int, duration_s: float,
                       warmup_s: float = 1.0, headers: dict[str, str] | None = None,
                       stream: bool = False) -> TokenLoadResult:
    """:func:`closed_loop` for ``/v1/completions`` or ``/v1/chat/completions``, counting output tokens.

    With ``stream=True`` each request asks for server-sent events (with a final usage chunk)
    and the time to its first streamed choice (the first token) is recorded as well.
    """
    result = TokenLoadResult(concurrency=concurrency, duration_s=duration_s)
    return asyncio.run(_drive(url, make_body, concurrency, duration_s, warmup_s, headers or {}, result,
                              _openai_exchange(stream)))
