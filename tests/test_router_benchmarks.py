"""The router benchmarks' harness measures what it says (never the router's speed as pass/fail).

``benchmarks.router_overhead`` and ``benchmarks.balance_quality`` rest on three pieces:
replicas and the router launcher (``benchmarks.router_bench_replica``) and the open-loop
generator (``benchmarks.router_loadgen``). These tests check each piece against what it
must do (the replica's time follows the tokens, the generator sends at the rate asked, the
router answers through the harness with a real token, two routers share one port), and that
the figures come out in the common JSON shape.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import pytest

from benchmarks import balance_quality, router_overhead
from benchmarks import router_bench_replica as bench
from benchmarks import router_loadgen as loadgen
from benchmarks.machine import write_result

RESULT_KEYS = {"benchmark", "ours", "anchor", "ratio", "goal", "meets_goal", "machine"}


@pytest.fixture
def llm_replica(tmp_path):
    """One token-paced replica process: α = 0.01 ms/input token, β = 1 ms/output token, γ = 5 ms, 2 slots."""
    port = bench.free_port()
    process = bench.start("llm-replicas", {"ports": [port], "cost": [0.01, 1.0, 5.0, 2]}, tmp_path / "replica.log")
    bench.wait_http(f"http://127.0.0.1:{port}/health", process)
    yield f"http://127.0.0.1:{port}"
    bench.stop(process)


@pytest.fixture
def fast_replica(tmp_path):
    port = bench.free_port()
    process = bench.start("fast-replica", {"port": port}, tmp_path / "fast.log")
    bench.wait_http(f"http://127.0.0.1:{port}/health", process)
    yield port
    bench.stop(process)


def complete(url: str, input_tokens: int, output_tokens: int) -> tuple[float, dict]:
    body = loadgen.completion_bodies("m", [(input_tokens, output_tokens)])[0]
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=30) as response:
        answer = json.loads(response.read())
    return time.perf_counter() - started, answer


def test_the_replica_takes_the_time_its_token_counts_cost(llm_replica):
    small_s, small = complete(llm_replica, 100, 10)  # 1 + 10 + 5 = 16 ms
    large_s, large = complete(llm_replica, 1000, 100)  # 10 + 100 + 5 = 115 ms: 10× the tokens
    assert large_s >= 0.115  # a sleep never ends early
    assert large_s > small_s
    assert small["usage"] == {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}
    assert large["usage"]["completion_tokens"] == 100


def test_a_replica_serves_c_requests_at_once_and_queues_the_rest(llm_replica):
    """3 requests of 105 ms on 2 slots: the last one ends no earlier than 2 × 105 ms after the first starts."""
    finished: list[float] = []
    started = time.perf_counter()

    def one() -> None:
        complete(llm_replica, 0, 100)
        finished.append(time.perf_counter() - started)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(finished) == 3
    assert max(finished) >= 2 * 0.105


def test_the_http_server_answers_pipelined_requests_in_order():
    async def exchange() -> bytes:
        server = await asyncio.get_running_loop().create_server(lambda: bench.HttpServer(bench.fast_handler),
                                                                "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(bench.http_request("127.0.0.1", port, "/invocations", b"{}") +
                     bench.http_request("127.0.0.1", port, "/nope", b'{"a": 1}'))
        await writer.drain()
        data = b""
        while data.count(b"HTTP/1.1") < 2 or not data.endswith(b"}"):
            data += await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
        server.close()
        return data

    data = asyncio.run(exchange())
    first, second = data.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200") and first.endswith(bench.FAST_ANSWER)
    assert second.startswith(b"404")


def test_poisson_arrivals_are_seeded_and_average_the_rate():
    offsets = loadgen.poisson_offsets(1000, 10.0, seed=3)
    assert offsets == loadgen.poisson_offsets(1000, 10.0, seed=3)
    assert offsets != loadgen.poisson_offsets(1000, 10.0, seed=4)
    assert offsets == sorted(offsets) and 0 < offsets[0] and offsets[-1] < 10.0
    assert len(offsets) == pytest.approx(10_000, rel=0.05)


def test_the_generator_sends_at_the_rate_asked_at_a_low_rate(fast_replica):
    requests = [bench.http_request("127.0.0.1", fast_replica, "/invocations", b"{}")]
    result = asyncio.run(loadgen.open_loop("127.0.0.1", fast_replica, requests, rate_rps=250, duration_s=4.0,
                                         warmup_s=0.5, connections=16, seed=0))
    assert result["errors"] == 0 and result["unanswered"] == 0 and result["statuses"] == {"200": sum(
        result["statuses"].values())}
    assert result["sent"] == pytest.approx(1000, rel=0.1)
    assert result["offered_rps"] == pytest.approx(250, rel=0.1)
    assert result["achieved_rps"] == pytest.approx(250, rel=0.1)
    # how many waited for a free connection depends on how busy the machine is: a figure, not a check
    assert 0 <= result["waited_for_connection"] <= result["sent"]
    assert 0 < result["p50_ms"] <= result["p90_ms"] <= result["p99_ms"] <= result["max_ms"]


def test_a_request_whose_connections_are_all_busy_waits_for_one_and_is_counted(llm_replica):
    """One connection to a replica that takes 105 ms a request, offered 40 a second: most arrivals
    find the connection busy; each waits for it (sent late, never dropped) and is counted."""
    port = int(llm_replica.rsplit(":", 1)[1])
    requests = [bench.http_request("127.0.0.1", port, "/v1/completions", body)
                for body in loadgen.completion_bodies("m", [(0, 100)])]
    result = asyncio.run(loadgen.open_loop("127.0.0.1", port, requests, rate_rps=40, duration_s=1.0, warmup_s=0.0,
                                         connections=1, seed=0))
    assert result["errors"] == 0 and result["unanswered"] == 0
    assert result["waited_for_connection"] > 0
    assert result["statuses"] == {"200": result["sent"]}


def test_a_refused_request_counts_as_an_error_not_a_latency(fast_replica):
    requests = [bench.http_request("127.0.0.1", fast_replica, "/missing", b"{}")]
    result = asyncio.run(loadgen.open_loop("127.0.0.1", fast_replica, requests, rate_rps=100, duration_s=0.5,
                                         warmup_s=0.0, connections=4))
    assert result["errors"] == sum(result["statuses"].values()) > 0
    assert set(result["statuses"]) == {"404"}


# ---- router_overhead: pure figures ----------------------------------------------------------

def level(rate: int, p99: float, errors: int = 0, achieved: float | None = None) -> dict:
    return {"rate_rps": rate, "achieved_rps": achieved if achieved is not None else rate * 0.99, "sent": rate,
            "errors": errors, "unanswered": 0,
            "statuses": {"200": rate} if not errors else {"200": rate, "502": errors},
            "p50_ms": p99 / 4, "p90_ms": p99 / 2, "p99_ms": p99, "max_ms": p99 * 2, "lateness_p99_ms": 0.5,
            "waited_for_connection": 0}


@pytest.mark.parametrize("router, direct, passes", [
    (level(1000, 3.0), level(1000, 0.2), True),
    (level(1000, 5.3), level(1000, 0.2), False),  # 5.1 ms added
    (level(1000, 1.0, errors=1), level(1000, 0.2), False),  # a failed request
    (level(1000, 1.0, achieved=900), level(1000, 0.2), False),  # fell behind
])
def test_a_sweep_level_passes_only_when_the_router_adds_at_most_5_ms_and_keeps_up(router, direct, passes):
    assert router_overhead.level_passes(router, direct) is passes


def test_the_sustained_rate_is_the_last_level_before_the_first_failure():
    levels = [{"rate_rps": r, "passes": p} for r, p in [(1000, True), (2000, True), (3000, False), (4000, True)]]
    assert router_overhead.max_sustained(levels) == 2000
    assert router_overhead.max_sustained([{"rate_rps": 1000, "passes": False}]) == 0


def overhead_repeat(router_p99: float, max_rps: int) -> dict:
    direct, router = level(1000, 0.2), level(1000, router_p99)
    return {"at_rate": {"direct": direct, "router": router, "added": router_overhead.added_ms(router, direct)},
            "sweep": [], "max_rps": max_rps, "router_cpu_ms_per_request": 0.3}


@pytest.mark.parametrize("router_p99s, max_rps, meets", [
    ([0.9, 1.1, 1.0], [5000, 6000, 5000], True),
    ([0.9, 1.5, 1.6], [5000, 6000, 5000], False),  # median added p99 1.3 ms
    ([0.9, 1.0, 1.0], [3000, 6000, 4000], False),  # median 4,000 RPS per core
])
def test_overhead_goal_is_judged_on_medians_and_written_in_the_common_shape(tmp_path, router_p99s, max_rps, meets):
    repeats = [overhead_repeat(p99, rps) for p99, rps in zip(router_p99s, max_rps)]
    ceiling = [{"rate_rps": 20000, "passes": True}]
    ours, anchor, ratio, met, reason = router_overhead.figures(repeats, ceiling)
    assert met is meets and (reason is None) is meets
    assert ours["added_p99_ms"]["n"] == 3 and set(ours["added_p99_ms"]) == {"min", "median", "max", "n"}
    assert ratio == pytest.approx(sorted(p / 0.2 for p in router_p99s)[1])
    assert anchor["generator"]["at_least_twice_router_max"] and "istio_envoy_added_p90_ms" in anchor["context"]
    written = write_result(str(tmp_path / "out.json"), benchmark="router_overhead", ours=ours, anchor=anchor,
                           ratio=ratio, goal=router_overhead.GOAL, meets_goal=met, unmet_reason=reason)
    assert RESULT_KEYS <= set(json.loads((tmp_path / "out.json").read_text())) and written["meets_goal"] is meets


def test_a_generator_too_slow_for_twice_the_router_voids_the_goal():
    repeats = [overhead_repeat(0.5, 6000)]
    _ours, _anchor, _ratio, met, reason = router_overhead.figures(repeats, [{"rate_rps": 10000, "passes": True},
                                                                             {"rate_rps": 15000, "passes": False}])
    assert not met and "generator" in reason


# ---- balance_quality: pure figures ----------------------------------------------------------

def test_the_trace_gives_the_token_counts_the_replicas_are_paced_by():
    if not balance_quality.TRACE.exists():
        pytest.skip(f"no trace at {balance_quality.TRACE}")
    tokens = balance_quality.read_trace()
    assert len(tokens) > 19_000 and all(i >= 0 and o >= 1 for i, o in tokens)
    assert 100 < balance_quality.capacity_rps(tokens) < 1000  # tens of ms per request, 32 slots


def balance_runs(p99: dict[str, dict[str, list[float]]]) -> list[dict]:
    return [{"repeat": repeat, "level": level_name, "balancer": balancer, "rate_rps": 300.0, "offered_rps": 300.0,
             "achieved_rps": 298.0, "sent": 2000, "errors": 0, "p50_ms": value / 3, "p99_ms": value, "max_ms": value,
             "lateness_p99_ms": 0.5, "waited_for_connection": 0, "replica_shares": [0.125] * 8,
             "service_p50_ms": 55.0, "service_p99_ms": 235.0}
            for level_name, by_balancer in p99.items() for balancer, values in by_balancer.items()
            for repeat, value in enumerate(values)]


APPLIED = {"route_has_policy": True, "balancers": list(balance_quality.BALANCERS)}


@pytest.mark.parametrize("p2c, support, meets", [
    (100.0, APPLIED, True),
    (250.0, APPLIED, False),  # over 0.5 × round robin's 400
    (100.0, {"route_has_policy": False, "balancers": []}, False),  # every balancer ran as p2c_units
])
def test_balance_goal_needs_both_ratios_at_every_level_and_a_router_that_applies_the_balancer(p2c, support, meets):
    others = {"p2c_requests": [150.0], "least_loaded": [95.0], "round_robin": [400.0], "random": [500.0]}
    runs = balance_runs({name: {"p2c_units": [p2c], **others} for name in ("70%", "90%")})
    ours, anchor, ratio, met, reason = balance_quality.figures(runs, support)
    assert met is meets and (reason is None) is meets
    assert ratio == pytest.approx(400.0 / p2c)
    assert set(ours["all_balancers"]["90%"]) == set(balance_quality.BALANCERS)
    assert anchor["round_robin"]["90%"]["p99_ms"]["median"] == 400.0


def two_router_runs(p99s: dict[int, list[float]], busiest: float) -> list[dict]:
    return [{"repeat": repeat, "routers": n, "rate_rps": 340.0, "achieved_rps": 338.0, "errors": 0, "unanswered": 0,
             "p50_ms": p99 / 3, "p99_ms": p99, "replica_shares": [0.125] * 8,
             "router_shares": [1.0] if n == 1 else [busiest, round(1 - busiest, 4)]}
            for n, values in p99s.items() for repeat, p99 in enumerate(values)]


def test_two_routers_are_compared_with_one_within_each_repeat():
    figures = balance_quality.two_router_figures(two_router_runs({1: [100.0, 120.0, 110.0], 2: [150.0, 120.0, 99.0]},
                                                                 busiest=0.52))
    assert figures["p99_two_over_one"]["median"] == 1.0  # 1.5, 1.0 and 0.9: the middle one
    assert figures["p99_two_over_one"]["max"] == 1.5
    assert figures["2_routers"]["busiest_router_share"]["median"] == 0.52
    assert figures["1_router"]["busiest_router_share"]["median"] == 1.0
    assert figures["2_routers"]["p99_ms"] == {"min": 99.0, "median": 120.0, "max": 150.0, "n": 3}


# ---- the whole harness, briefly, through the real router ------------------------------------

@pytest.mark.slow
def test_the_overhead_harness_goes_through_the_real_router_with_a_real_token(tmp_path):
    settings = router_overhead.Settings(repeats=1, at_rate_rps=200, at_rate_s=1.0, sweep_s=1.0,
                                        sweep_levels=(200,), ceiling_s=1.0, ceiling_levels=(1000,), warmup_s=0.3)
    outcome = router_overhead.run(settings, tmp_path, log=lambda line: None)
    repeat = outcome["ours"]["repeats"][0]
    router, direct = repeat["at_rate"]["router"], repeat["at_rate"]["direct"]
    assert router_overhead.clean(router) and router_overhead.clean(direct)  # 200s: the token was accepted
    assert router["sent"] == direct["sent"] > 0  # the same arrivals on both sides
    assert repeat["router_cpu_ms_per_request"] > 0
    assert "load_average_1m" in router  # what else ran meanwhile is recorded with the figure
    assert outcome["anchor"]["generator"]["ceiling_levels"][0]["rate_rps"] == 1000
    assert outcome["ours"]["router_gc_frozen"] is True  # as serving.router.server.main runs it


@pytest.mark.slow
def test_the_balance_harness_sends_each_balancer_through_the_real_router(tmp_path):
    settings = balance_quality.Settings(repeats=1, measured_requests=120, warmup_s=0.3)
    runs = balance_quality.run(settings, tmp_path, levels=balance_quality.LEVELS[:1],
                               balancers=("p2c_units", "round_robin"), log=lambda line: None)
    assert [r["balancer"] for r in runs] == ["p2c_units", "round_robin"]
    for run in runs:
        assert run["errors"] == 0 and run["sent"] > 0
        assert sum(run["replica_shares"]) == pytest.approx(1.0, abs=0.01) and len(run["replica_shares"]) == 8
    support = bench.balancer_support()
    if support["route_has_policy"] and "round_robin" in support["balancers"]:
        shares = runs[1]["replica_shares"]  # round robin: every replica within a request of the others
        assert max(shares) - min(shares) <= 2 / runs[1]["sent"]



@pytest.mark.slow
def test_two_routers_share_one_client_port_and_each_takes_part_of_the_requests(tmp_path):
    settings = balance_quality.Settings(repeats=1, measured_requests=150, warmup_s=0.3)
    runs = balance_quality.run_two_routers(settings, tmp_path, log=lambda line: None)
    assert [r["routers"] for r in runs] == [1, 2]
    for run in runs:
        assert run["errors"] == 0 and run["unanswered"] == 0 and run["sent"] > 0
        assert sum(run["router_shares"]) == pytest.approx(1.0, abs=0.01)
    one, two = runs
    assert one["router_shares"] == [1.0]
    assert len(two["router_shares"]) == 2 and min(two["router_shares"]) > 0.2  # the kernel spread 512 connections
