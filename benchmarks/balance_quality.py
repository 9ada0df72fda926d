"""How well each of the router's balancers spreads LLM requests of very different cost.

    .venv/bin/python -m benchmarks.balance_quality [--quick] --json OUT.json

**Replicas.** 8 fake LLM replicas (``benchmarks.router_bench_replica.TokenPacedReplica``,
4 servers in each of 2 processes) whose service time follows each request's token counts:
a replica serves up to ``c`` = 4 requests at once, FIFO behind that (a fixed c-slot queue,
not processor sharing), each holding its slot for ``α·i + β·o + γ`` ms (an ``asyncio.sleep``:
a GPU's time, not a CPU's). The coefficients are a GPU-like α = 0.15 ms per input token,
β = 15 ms per output token, γ = 30 ms at c = 4, **time-compressed 40×** (α = 0.00375,
β = 0.375, γ = 0.75 ms), so a request of the trace's median size (1,020 in, 129 out) takes
about 52 ms and the mean request about 84 ms.

**Requests.** Token counts from the Azure LLM conversation trace
(``../shared/data/azure-llm-trace-2023/AzureLLMInferenceTrace_conv.csv``, CC-BY 4.0), drawn
at random (seeded per repeat), unscaled: ``{"model", "prompt": [i token ids], "max_tokens": o}``
to ``/v1/completions`` of an endpoint with runtime ``vllm``, whose route carries a
``RouteCost`` with the same α, β, γ, c, so the router prices each request at exactly the
replica time it will take (the fake answers exactly ``o`` tokens, as with ``ignore_eos``:
the best case for cost-aware balancing; real ``max_tokens`` is an upper bound).

**Load.** Open-loop Poisson arrivals (same seed for every balancer in a repeat) at 70 % and
90 % of the fleet's capacity (8 × c / mean service time of the requests sent), and at 70 %
with one replica 3× slower (the fleet then has 7⅓/8 of its capacity, so that load is 76 %
of what it can do, and round robin sends that replica 2.1× what it can serve). For each
level and balancer (``p2c_units``, ``p2c_requests``, ``least_loaded``, ``round_robin``,
``random``, set with ``EndpointRoute(policy=RoutePolicy(balancer=…))``): p50 and p99 from
send to last byte, and each replica's share of the requests. Every run gets a fresh router.

**Goal**, at every level: p2c_units p99 ≤ 0.5 × round_robin p99 and ≤ 1.1 × least_loaded
p99 (medians over repeats of the within-repeat ratios). Headline ratio: round_robin p99 /
p2c_units p99 at 90 %. Full: ≥ 2,000 measured requests per level and balancer, 3 repeats,
about 12 minutes; ``--quick``: 500 requests, 1 repeat, under 3 minutes.

**Two routers** (an extra comparison, not the headline; ``ours.two_routers``). Active-active
routers share no in-flight counts, so each balances on half the picture. p2c_units at 90 %
runs through two router processes sharing one client port (each bound by
``serving.router.server.listening_sockets``: SO_REUSEPORT plus a port of its own) and, with the
same requests and arrivals, through one router; the generator's keep-alive connections all
go to the shared port and the kernel hands each to one router. Per side: p50 / p99, and the
share of the requests each router took (``modelplane_router_requests_total`` from each
router's ``/metrics``, read on its own port).
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import secrets
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks import router_bench_replica as bench
from cluster.local.replica import free_ports
from benchmarks import router_loadgen as loadgen
from benchmarks.machine import write_result
from benchmarks.repeats import spread

# The Azure trace sits beside the checkout (../shared/data); MODELPLANE_TRACE_CSV points elsewhere.
TRACE = Path(os.environ.get("MODELPLANE_TRACE_CSV", Path(__file__).resolve().parents[2] / "shared" / "data"
                            / "azure-llm-trace-2023" / "AzureLLMInferenceTrace_conv.csv"))
BALANCERS = ("p2c_units", "p2c_requests", "least_loaded", "round_robin", "random")
ENDPOINT = "llm"
TIME_SCALE = 40  # replica time = GPU-like time / 40
GPU_COST = (0.15, 15.0, 30.0)  # α ms/input token, β ms/output token, γ ms, before compression
SLOTS = 4
REPLICAS, PROCESSES = 8, 2
SLOWDOWN = 3.0
TWO_ROUTERS_LOAD, ROUTER_COUNTS = 0.90, (1, 2)


@dataclass(frozen=True)
class Level:
    name: str
    load: float  # fraction of the unslowed fleet's capacity
    slow_replicas: int = 0


LEVELS = (Level("70%", 0.70), Level("90%", 0.90), Level("70%, one replica 3x slower", 0.70, slow_replicas=1))


@dataclass(frozen=True)
class Settings:
    repeats: int
    measured_requests: int
    warmup_s: float


FULL, QUICK = Settings(repeats=3, measured_requests=2000, warmup_s=2.0), Settings(1, 500, 1.0)


def cost() -> tuple[float, float, float, int]:
    """(α, β, γ, c) as the replicas and the router's RouteCost both use them (ms, compressed).

    >>> cost()
    (0.00375, 0.375, 0.75, 4)
    """
    alpha, beta, gamma = (value / TIME_SCALE for value in GPU_COST)
    return alpha, beta, gamma, SLOTS


def read_trace(path: Path = TRACE) -> list[tuple[int, int]]:
    """(input tokens, output tokens) of every request in the trace; outputs of 0 count as 1."""
    with open(path, newline="") as handle:
        return [(int(row["ContextTokens"]), max(1, int(row["GeneratedTokens"]))) for row in csv.DictReader(handle)]


def capacity_rps(tokens: list[tuple[int, int]], replicas: int = REPLICAS) -> float:
    """Requests/s the fleet serves flat out: replicas × c / mean service time.

    >>> round(capacity_rps([(1000, 100), (1000, 300)]), 1)  # 42 and 117 ms: mean 79.5 ms
    402.5
    """
    alpha, beta, gamma, slots = cost()
    mean_ms = statistics.fmean(alpha * i + beta * o + gamma for i, o in tokens)
    return replicas * slots / (mean_ms / 1000)


def service_ms(tokens: list[tuple[int, int]], q: float) -> float:
    """The q-quantile of the requests' own service time on an unslowed replica: the floor under any balancer's.

    >>> service_ms([(1000, 100)] * 99 + [(1000, 1000)], 0.99)
    42.0
    """
    alpha, beta, gamma, _ = cost()
    ordered = sorted(alpha * i + beta * o + gamma for i, o in tokens)
    return round(ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))], 2)


def ratio_checks(p99: dict[str, dict[str, list[float]]]) -> dict[str, dict]:
    """Per level: p2c_units p99 over round_robin's and over least_loaded's, within each repeat.

    >>> checks = ratio_checks({"90%": {"p2c_units": [100.0], "round_robin": [400.0], "least_loaded": [95.0]}})
    >>> checks["90%"]["vs_round_robin"]["median"], checks["90%"]["passes"]
    (0.25, True)
    """
    checks = {}
    for level, by_balancer in p99.items():
        ours = by_balancer["p2c_units"]
        vs_rr = [o / r for o, r in zip(ours, by_balancer["round_robin"])]
        vs_ll = [o / ll for o, ll in zip(ours, by_balancer["least_loaded"])]
        checks[level] = {"vs_round_robin": spread(vs_rr), "vs_least_loaded": spread(vs_ll),
                         "passes": statistics.median(vs_rr) <= 0.5 and statistics.median(vs_ll) <= 1.1}
    return checks


def figures(runs: list[dict], support: dict) -> tuple[dict, dict, float, bool, str | None]:
    """(ours, anchor, ratio, meets_goal, unmet_reason) from every (repeat, level, balancer) run."""
    levels = [level.name for level in LEVELS if any(r["level"] == level.name for r in runs)]
    table, p99 = {}, {}
    for level in levels:
        table[level], p99[level] = {}, {}
        for balancer in BALANCERS:
            mine = sorted((r for r in runs if r["level"] == level and r["balancer"] == balancer),
                          key=lambda r: r["repeat"])
            p99[level][balancer] = [r["p99_ms"] for r in mine]
            table[level][balancer] = {
                "p50_ms": spread([r["p50_ms"] for r in mine]), "p99_ms": spread(p99[level][balancer]),
                "rate_rps": spread([r["rate_rps"] for r in mine]),
                "achieved_rps": spread([r["achieved_rps"] for r in mine]),
                "errors": sum(r["errors"] + r.get("unanswered", 0) for r in mine),
                "busiest_replica_share": spread([max(r["replica_shares"]) for r in mine]),
                "idlest_replica_share": spread([min(r["replica_shares"]) for r in mine])}
    checks = ratio_checks(p99)
    floors = {level: {"p50_ms": spread([r["service_p50_ms"] for r in runs if r["level"] == level]),
                      "p99_ms": spread([r["service_p99_ms"] for r in runs if r["level"] == level])}
              for level in levels}
    headline = "90%" if "90%" in p99 else levels[0]
    ratio = statistics.median(r / o for r, o in zip(p99[headline]["round_robin"], p99[headline]["p2c_units"]))
    applied = support["route_has_policy"] and set(BALANCERS) <= set(support["balancers"])
    errors = sum(r["errors"] + r.get("unanswered", 0) for r in runs)
    meets = applied and errors == 0 and all(check["passes"] for check in checks.values())
    reasons = []
    if not applied:
        reasons.append("this router does not apply EndpointRoute.policy.balancer for every balancer measured "
                       f"({support}); the runs did not compare balancers")
    if errors:
        reasons.append(f"{errors} requests failed or were not answered within 30 s of the last send")
    reasons += [f"{level}: p2c_units p99 is {c['vs_round_robin']['median']:.2f}× round_robin's (goal ≤ 0.5) and "
                f"{c['vs_least_loaded']['median']:.2f}× least_loaded's (goal ≤ 1.1)"
                for level, c in checks.items() if not c["passes"]]
    ours = {"p2c_units": {level: table[level]["p2c_units"] for level in levels}, "checks": checks,
            "all_balancers": table, "service_time_of_requests_sent": floors, "balancer_support": support, "runs": runs}
    anchor = {name: {level: table[level][name] for level in levels} for name in ("round_robin", "least_loaded")}
    return ours, anchor, ratio, meets, "; ".join(reasons) or None


def requests_total(metrics_text: str) -> float:
    """The requests a router answered, summed over endpoints and codes, from its ``/metrics`` text.

    >>> requests_total('modelplane_router_requests_total{code="200",endpoint="llm"} 1200.0\\n'
    ...                'modelplane_router_requests_total{code="502",endpoint="llm"} 3.0\\n'
    ...                'modelplane_router_requests_created{code="200",endpoint="llm"} 1.7e+09\\n')
    1203.0
    """
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith("modelplane_router_requests_total{"))


def two_router_figures(runs: list[dict]) -> dict:
    """p2c_units at 90 % through one router and through two sharing a port, min/median/max over repeats.

    ``p99_two_over_one``: two routers' p99 over one router's, within each repeat.
    ``busiest_router_share``: the largest share of the requests one router took (0.5 is an even split).
    """
    by_count = {n: sorted((r for r in runs if r["routers"] == n), key=lambda r: r["repeat"]) for n in ROUTER_COUNTS}
    sides = {f"{n}_router{'s' if n > 1 else ''}": {
        "p50_ms": spread([r["p50_ms"] for r in mine]), "p99_ms": spread([r["p99_ms"] for r in mine]),
        "rate_rps": spread([r["rate_rps"] for r in mine]), "achieved_rps": spread([r["achieved_rps"] for r in mine]),
        "errors": sum(r["errors"] + r.get("unanswered", 0) for r in mine),
        "busiest_router_share": spread([max(r["router_shares"]) for r in mine]),
        "busiest_replica_share": spread([max(r["replica_shares"]) for r in mine])}
        for n, mine in by_count.items() if mine}
    pairs = list(zip(by_count[1], by_count[2]))
    if pairs:
        sides["p99_two_over_one"] = spread([two["p99_ms"] / one["p99_ms"] for one, two in pairs])
    return sides


# ---- running it -----------------------------------------------------------------------------

class Fleet:
    """The replica processes of one level (``slow`` of them SLOWDOWN× slower); ``with`` stops them."""

    def __init__(self, log_dir: Path, slow: int) -> None:
        self.ports = free_ports("127.0.0.1", REPLICAS)
        slowdown = {str(port): SLOWDOWN for port in self.ports[:slow]}
        per_process = REPLICAS // PROCESSES
        self.processes = [bench.start("llm-replicas", {"ports": self.ports[k:k + per_process], "cost": list(cost()),
                                                       "slowdown": slowdown}, log_dir / "replicas.log")
                          for k in range(0, REPLICAS, per_process)]
        for index, port in enumerate(self.ports):
            bench.wait_http(f"http://127.0.0.1:{port}/health", self.processes[index // per_process])

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def served(self) -> list[int]:
        return [bench.get_json(f"{url}/stats")["served"] for url in self.urls]

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            bench.stop(process)


def run_one(fleet: Fleet, log_dir: Path, balancer: str, tokens: list[tuple[int, int]], rate_rps: float,
            settings: Settings, seed: int, routers: int = 1) -> dict:
    """One balancer at one rate: ``routers`` fresh routers sharing a client port, open-loop load,
    per-replica shares and each router's share of the requests."""
    token, port = f"mp_bench_{secrets.token_urlsafe(24)}", bench.free_port()
    spec = {"port": port, "endpoint": ENDPOINT, "runtime": "vllm", "token": token, "replicas": fleet.urls,
            "cost": list(cost()), "balancer": balancer}
    started: list[tuple] = []
    try:
        for _ in range(routers):
            started.append(bench.start_router(spec, log_dir))
        before = fleet.served()
        result = loadgen.run_loadgen({"host": "127.0.0.1", "port": port, "path": "/v1/completions",
                                      "headers": {"Authorization": f"Bearer {token}"},
                                      "completions": {"model": ENDPOINT, "tokens": tokens}, "rate_rps": rate_rps,
                                      "duration_s": settings.measured_requests / rate_rps,
                                      "warmup_s": settings.warmup_s, "connections": 512, "seed": seed}, None)
        served = [after - b for after, b in zip(fleet.served(), before)]
        handled = [requests_total(bench.get_text(f"http://127.0.0.1:{own}/metrics")) for _, own in started]
    finally:
        for process, _ in started:
            bench.stop(process)
    total, answered = sum(served) or 1, sum(handled) or 1
    kept = ("rate_rps", "offered_rps", "achieved_rps", "sent", "errors", "unanswered", "p50_ms", "p99_ms", "max_ms",
            "lateness_p99_ms", "waited_for_connection")
    return {k: result[k] for k in kept} | {
        "replica_shares": [round(s / total, 4) for s in served],
        "router_shares": [round(h / answered, 4) for h in handled]}


def run(settings: Settings, log_dir: Path, levels=LEVELS, balancers=BALANCERS, log=print) -> list[dict]:
    trace = read_trace()
    runs = []
    for repeat in range(settings.repeats):
        rng = random.Random(repeat)
        for level_index, level in enumerate(levels):
            with Fleet(log_dir, level.slow_replicas) as fleet:
                # enough requests for warm-up and window, plus Poisson's spread, in the order they are sent
                tokens = [rng.choice(trace) for _ in range(int(settings.measured_requests * 1.5) + 2000)]
                rate = level.load * capacity_rps(tokens)
                sent = tokens[:int(rate * (settings.warmup_s + settings.measured_requests / rate))]
                floor = {"service_p50_ms": service_ms(sent, 0.5), "service_p99_ms": service_ms(sent, 0.99)}
                order = list(balancers) if (repeat + level_index) % 2 == 0 else list(reversed(balancers))
                for balancer in order:
                    result = run_one(fleet, log_dir, balancer, tokens, rate, settings, seed=100 * repeat + level_index)
                    runs.append({"repeat": repeat, "level": level.name, "balancer": balancer, **result, **floor})
                    log(f"repeat {repeat + 1} {level.name} {balancer}: {rate:.0f} RPS p50 {result['p50_ms']} ms "
                        f"p99 {result['p99_ms']} ms, shares {min(result['replica_shares']):.3f}-"
                        f"{max(result['replica_shares']):.3f}")
    return runs


def run_two_routers(settings: Settings, log_dir: Path, log=print) -> list[dict]:
    """p2c_units at 90 % through one router and through two sharing its port, same requests and arrivals."""
    trace, runs = read_trace(), []
    for repeat in range(settings.repeats):
        rng = random.Random(1000 + repeat)
        with Fleet(log_dir, 0) as fleet:
            tokens = [rng.choice(trace) for _ in range(int(settings.measured_requests * 1.5) + 2000)]
            rate = TWO_ROUTERS_LOAD * capacity_rps(tokens)
            for routers in (ROUTER_COUNTS if repeat % 2 == 0 else tuple(reversed(ROUTER_COUNTS))):
                result = run_one(fleet, log_dir, "p2c_units", tokens, rate, settings, seed=1000 + repeat,
                                 routers=routers)
                runs.append({"repeat": repeat, "routers": routers, **result})
                log(f"repeat {repeat + 1} two routers: p2c_units through {routers}: {rate:.0f} RPS p50 "
                    f"{result['p50_ms']} ms p99 {result['p99_ms']} ms, router shares {result['router_shares']}")
    return runs


def notes(settings: Settings) -> list[str]:
    alpha, beta, gamma, slots = cost()
    return [
        f"replica model: {slots} FIFO slots per replica (not processor sharing), service (α·i + β·o + γ) ms with "
        f"α={alpha} β={beta} γ={gamma}: a GPU-like α=0.15, β=15, γ=30 ms compressed {TIME_SCALE}× in time",
        f"{REPLICAS} replicas as {PROCESSES} processes of {REPLICAS // PROCESSES} servers; the router, the replicas "
        "and the load generator are separate processes, none pinned, on 2 shared cores",
        "token counts: Azure LLM trace 2023, conversation service, drawn with replacement (seed = repeat), unscaled; "
        "prompts are lists of token ids so the router counts input tokens exactly; max_tokens = the trace's output "
        "tokens and the fake answers exactly that many",
        "arrivals: Poisson, the same seed for every balancer within a repeat and level; capacity = 8 × 4 / mean "
        "service time of the drawn requests; the slowed level's rate is 70 % of the unslowed fleet's capacity",
        f"{settings.measured_requests} measured requests per level and balancer after {settings.warmup_s:g} s of "
        f"warm-up; {settings.repeats} repeat(s); figures are min/median/max over repeats, ratios taken within a repeat",
        "each run starts a fresh router (RouterConfig defaults) with a static table: EndpointRoute(runtime='vllm', "
        "cost=RouteCost(α, β, γ, 4), policy=RoutePolicy(balancer=name))",
        "the router parses every prompt (token-id lists of up to 14k ids, about 0.3 ms of its CPU per 1,000 ids) "
        "on the same 2 cores as everything else; latency includes that",
        "routers are started as serving.router.server.main starts them: listening_sockets (SO_REUSEPORT client port "
        "plus an own port), uvicorn on uvloop and httptools, settle_collector() (gc.freeze) before serving",
        f"two_routers: p2c_units at {TWO_ROUTERS_LOAD:.0%} through 2 router processes sharing one client port "
        "against the same requests and arrivals through 1 (fresh replicas, tokens drawn with seed 1000 + repeat, "
        "order alternating); 512 keep-alive connections to the shared port, each given to one router by the "
        "kernel; router shares from each router's modelplane_router_requests_total, read on its own port",
    ]


GOAL = ("p2c_units p99 ≤ 0.5 × round_robin p99 and ≤ 1.1 × least_loaded p99 at every level (70 %, 90 %, 70 % with "
        "one replica 3× slower; medians of within-repeat ratios); headline ratio = round_robin p99 / p2c_units p99 "
        "at 90 %")


def log_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="500 requests per level and balancer, 1 repeat")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    support = bench.balancer_support()
    with tempfile.TemporaryDirectory(prefix="balance_quality-") as log_dir:
        runs = run(settings, Path(log_dir), log=log_to_stderr)
        two_routers = run_two_routers(settings, Path(log_dir), log=log_to_stderr)
    ours, anchor, ratio, meets, reason = figures(runs, support)
    ours["two_routers"] = two_router_figures(two_routers) | {"runs": two_routers}
    ours["notes"] = notes(settings)
    return write_result(args.json, benchmark="balance_quality", ours=ours, anchor=anchor, ratio=ratio, goal=GOAL,
                        meets_goal=meets, unmet_reason=reason)


if __name__ == "__main__":
    main()
