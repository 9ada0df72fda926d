"""The benchmarks' load generator counts what it says it counts (never timings as pass/fail)."""

import pytest

from benchmarks.loadgen import LoadResult, closed_loop, closed_loop_openai
from tests.fake_replicas import FakeReplica


@pytest.fixture(scope="module")
def replica():
    started = FakeReplica("bench").start()
    yield started
    started.stop()


def test_closed_loop_counts_answers_and_refusals_apart(replica):
    ok = closed_loop(f"{replica.url}/invocations", lambda i: {"dataframe_split": {"data": [[i]]}},
                     concurrency=3, duration_s=0.5, warmup_s=0.1)
    assert ok.completed > 0 and ok.errors == 0 and ok.error_samples == []
    refused = closed_loop(f"{replica.url}/missing", lambda i: {}, concurrency=1, duration_s=0.3, warmup_s=0)
    assert refused.completed == 0 and refused.errors > 0
    assert refused.error_samples[0].startswith("404")


def test_openai_streaming_counts_tokens_and_time_to_first_token(replica):
    result = closed_loop_openai(f"{replica.url}/v1/chat/completions", lambda i: {"model": "m", "messages": []},
                                concurrency=2, duration_s=0.5, warmup_s=0.1, stream=True)
    assert result.completed > 0
    assert result.output_tokens == 3 * result.completed  # the fake streams "She", " goes", "."
    assert len(result.ttfts_s) == result.completed


def test_nearest_rank_percentile():
    result = LoadResult(concurrency=1, duration_s=1.0, latencies_s=[i / 1000 for i in range(1, 201)])
    assert result.percentile_ms(0.99) == pytest.approx(198.0)
    assert result.percentile_ms(0.5) == pytest.approx(100.0)
