"""Running a sweep against a live replica: closed-loop requests of exact shapes, timed one by one.

LLMs (vLLM's OpenAI server): each request is a completion whose prompt is a list of exactly
``input_tokens`` token ids, drawn at random from the vocabulary so that vLLM's prefix cache
cannot make prefill free, with ``max_tokens = min_tokens = output_tokens`` and
``ignore_eos``, streamed, so that both time to first token and total latency are seen.
Classic models (the pyfunc scoring server): the model's input example posted to
``/invocations``. At each point ``concurrency`` workers keep one request each in flight
until ``requests_for(concurrency)`` requests have finished or ``max_point_s`` has passed.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from costmodel.sweep import RequestSample, SweepGrid, SweepPoint

FIRST_TOKEN_ID = 100  # below this most vocabularies keep special and control tokens


def llm_body(model_name: str, input_tokens: int, output_tokens: int, vocab_size: int, rng: random.Random) -> dict:
    prompt = [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(input_tokens)]
    return {"model": model_name, "prompt": prompt, "max_tokens": output_tokens, "min_tokens": output_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True}


async def _llm_request(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[bool, float | None]:
    """Send one streamed completion; (ok, seconds to the first text chunk)."""
    started = time.perf_counter()
    first = None
    async with session.post(url, json=body) as response:
        if response.status != 200:
            await response.read()
            return False, None
        async for raw in response.content:
            line = raw.strip()
            if first is None and line.startswith(b"data: {") and b'"text"' in line:
                first = time.perf_counter() - started
    return True, first


async def _classic_request(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[bool, float | None]:
    async with session.post(url, json=body) as response:
        await response.read()
        return response.status == 200, None


async def _point(send: Callable, url: str, make_body: Callable[[], dict], input_tokens: int, output_tokens: int,
                 concurrency: int, requests: int, max_point_s: float) -> tuple[list[RequestSample], float]:
    samples: list[RequestSample] = []
    remaining = [requests]
    started = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=max(60.0, max_point_s))
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        async def worker() -> None:
            while remaining[0] > 0 and time.perf_counter() - started < max_point_s:
                remaining[0] -= 1
                sent = time.perf_counter()
                try:
                    ok, ttft_s = await send(session, url, make_body())
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    ok, ttft_s = False, None
                latency_ms = (time.perf_counter() - sent) * 1000
                samples.append(RequestSample(input_tokens, output_tokens, concurrency, latency_ms,
                                             ttft_s * 1000 if ttft_s is not None else None, ok))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.perf_counter() - started


def run_sweep(base_url: str, grid: SweepGrid, *, model_name: str | None = None, vocab_size: int | None = None,
              classic_body: dict | None = None, seed: int = 0,
              log: Callable[[str], None] = print) -> tuple[list[RequestSample], list[SweepPoint]]:
    """Every point of ``grid`` against the replica at ``base_url``; (all request samples, one point each)."""
    rng = random.Random(seed)
    if classic_body is None:
        if not model_name or not vocab_size:
            raise ValueError("an LLM sweep needs the served model name and the vocabulary size")
        url, send = f"{base_url}/v1/completions", _llm_request
    else:
        url, send = f"{base_url}/invocations", _classic_request

    def body_for(i: int, o: int) -> Callable[[], dict]:
        if classic_body is not None:
            return lambda: classic_body
        return lambda: llm_body(model_name, i, o, vocab_size, rng)

    # Warm the engine up first: the first forward passes of a fresh process are slower.
    asyncio.run(_point(send, url, body_for(16, 4), 16, 4, 2, 4, 30.0))
    all_samples: list[RequestSample] = []
    points: list[SweepPoint] = []
    for input_tokens, output_tokens, concurrency in grid.points():
        samples, wall_s = asyncio.run(_point(send, url, body_for(input_tokens, output_tokens), input_tokens,
                                             output_tokens, concurrency, grid.requests_for(concurrency),
                                             grid.max_point_s))
        point = SweepPoint.aggregate(samples, wall_s)
        log(f"in {input_tokens:>4} out {output_tokens:>3} c {concurrency:>2}: p50 {point.p50_latency_ms:.0f} ms, "
            f"p99 {point.p99_latency_ms:.0f} ms, {point.throughput_rps:.1f} req/s, {point.n_failed} failed")
        all_samples += samples
        points.append(point)
    return all_samples, points


def classic_input_example(model_dir: Path) -> dict | None:
    """The request body for a classic model: its logged input example (MLflow's serving format);
    None when it was logged without one."""
    candidates = sorted(Path(model_dir).glob("serving_input_example.json")) + sorted(
        Path(model_dir).glob("input_example.json"))
    if not candidates:
        return None
    data = json.loads(candidates[0].read_text())
    return data if {"dataframe_split", "dataframe_records", "inputs", "instances"} & set(data) else {
        "dataframe_split": data}
