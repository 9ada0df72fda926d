"""The per-request routing model: the router's own balancers, replicas that share their time with a
batching gain, and a comparison of balancers on the same requests."""

import random
from dataclasses import replace

import numpy as np
import pytest

import serving.router.balancing as balancing
from autoscale.sim import routing
from autoscale.sim.routing import compare, simulate, summarize
from autoscale.sim.workload import ReplicaModel, Workload, make_workload, read_sizes
from serving.router.balancing import Balancer


def synthetic_sizes(n=2000, seed=7):
    """Azure-like spread: prompts around 1,000 tokens, outputs around 130 with a tail cut at 1,000 as the trace's."""
    rng = np.random.default_rng(seed)
    return (np.minimum(8000, rng.lognormal(6.8, 0.7, n)).astype(int),
            np.clip(rng.lognormal(4.9, 0.9, n), 1, 1000).astype(int))


SIZES = synthetic_sizes()


def fixed(arrival_ms, demand_ms, model=ReplicaModel(), replicas=1, horizon_ms=1e9):
    """Requests of the given demands, every one measured: α = 1 ms per input token, β = γ = 0."""
    model = replace(model, alpha_ms_per_input_token=1.0, beta_ms_per_output_token=0.0, gamma_ms=0.0)
    return Workload(replicas, model, np.asarray(arrival_ms, dtype=float), np.asarray(demand_ms, dtype=float),
                    np.zeros(len(demand_ms)), 0.0, horizon_ms, horizon_ms, 1.0, 1.0, 1.0)


# -- the router's own objects ----------------------------------------------------------------

def test_it_calls_the_routers_balancing_objects_not_copies():
    assert routing.make_balancer is balancing.make_balancer
    assert routing.BALANCERS is balancing.BALANCERS
    assert routing.Snapshot is balancing.Snapshot


class FirstReplica:
    def pick(self, candidates, score, rng):
        return candidates[0]


class Spy:
    """A scorer that writes down what the router's dicts held at each pick."""

    def __init__(self):
        self.seen = []

    def score(self, url, snapshot):
        self.seen.append((id(snapshot.units), sum(snapshot.requests.values()), sum(snapshot.units.values())))
        return 1.0


def test_a_balancer_registered_with_the_router_is_the_one_simulated(monkeypatch):
    monkeypatch.setitem(balancing.BALANCERS, "first", lambda: Balancer("first", [], [], FirstReplica()))
    record = simulate(make_workload(4, 0.5, 10.0, 0, SIZES, drain_s=0.0), "first")
    assert record.balancer == "first"
    assert set(record.replica_of[record.replica_of >= 0].tolist()) == {0}


def test_the_snapshot_dicts_are_live_counts_of_what_is_in_flight(monkeypatch):
    spy = Spy()
    least_loaded = balancing.make_balancer("least_loaded").picker  # scores every replica at each pick
    monkeypatch.setitem(balancing.BALANCERS, "spy", lambda: Balancer("spy", [], [(spy, 1.0)], least_loaded))
    workload = fixed([0.0, 10.0, 20.0, 150.0, 400.0], [100.0, 100.0, 100.0, 50.0, 50.0],
                     ReplicaModel(batching_k=0.0), replicas=2)
    record = simulate(workload, "spy", slow_factor=1.0)
    per_pick = spy.seen[::2]  # two replicas scored per pick
    assert len({dict_id for dict_id, _, _ in per_pick}) == 1  # one dict, updated in place
    # in flight when each request arrives: arrived before it, minus finished by then
    expected = [sum(1 for j in range(i) if record.finish_ms[j] > workload.arrival_ms[i]) for i in range(5)]
    assert [requests for _, requests, _ in per_pick] == expected
    units_per_request = workload.model.units(workload.input_tokens, 0)
    assert [units for _, _, units in per_pick] == pytest.approx(
        [sum(units_per_request[j] for j in range(i) if record.finish_ms[j] > workload.arrival_ms[i]) for i in range(5)])


# -- the replica: processor sharing with a batching gain ---------------------------------------

@pytest.mark.parametrize("name, arrival_ms, demand_ms, model, slow_factor, finish_ms", [
    ("one request alone takes its demand", [5.0], [2118.0], ReplicaModel(), 1.0, [2123.0]),
    ("on the slowed replica it takes slow_factor × its demand", [0.0], [100.0], ReplicaModel(), 3.0, [300.0]),
    ("two at once each run at g(2)/2 = 1/(1 + k): k = 0.5 → 150 ms", [0.0, 0.0], [100.0, 100.0],
     ReplicaModel(batching_k=0.5), 1.0, [150.0, 150.0]),
    ("two at once with the default k = 0.05 → 105 ms", [0.0, 0.0], [100.0, 100.0], ReplicaModel(), 1.0,
     [105.0, 105.0]),
    ("staggered: 50 ms alone, 50 ms of demand at 2/3 (75 ms), then the rest alone", [0.0, 50.0], [100.0, 100.0],
     ReplicaModel(batching_k=0.5), 1.0, [125.0, 175.0]),
    ("k = 1 is one shared server: the short one leaves at 2 × its demand", [0.0, 0.0], [300.0, 100.0],
     ReplicaModel(batching_k=1.0), 1.0, [400.0, 200.0]),
    ("max_batch 1 with k = 0 is a FIFO queue", [0.0, 0.0, 0.0], [100.0, 30.0, 10.0],
     ReplicaModel(batching_k=0.0, max_batch=1), 1.0, [100.0, 130.0, 140.0]),
    ("max_batch 2 with k = 0: the third waits for the first slot", [0.0, 0.0, 0.0], [100.0, 30.0, 10.0],
     ReplicaModel(batching_k=0.0, max_batch=2), 1.0, [100.0, 30.0, 40.0]),
])
def test_completion_times_match_the_analytic_ones(name, arrival_ms, demand_ms, model, slow_factor, finish_ms):
    record = simulate(fixed(arrival_ms, demand_ms, model), "p2c_units", slow_factor=slow_factor)
    assert record.finish_ms.tolist() == pytest.approx(finish_ms), name


def test_one_shared_server_matches_m_g_1_processor_sharing():
    """k = 1, one replica at load ρ: the mean latency is E[S] / (1 − ρ) whatever the sizes' spread."""
    model = ReplicaModel(batching_k=1.0, target_concurrency=1)
    workload = make_workload(1, 0.5, 100000.0, seed=3, sizes=SIZES, model=model, drain_s=120.0)
    result = summarize(workload, simulate(workload, "p2c_units", slow_factor=1.0))
    mean_demand_ms = float(np.mean(model.demand_ms(*(np.asarray(c, dtype=float) for c in SIZES))))
    assert result.requests_unfinished == 0
    assert result.mean_ms == pytest.approx(mean_demand_ms / (1 - 0.5), rel=0.1)


# -- the run -------------------------------------------------------------------------------------

@pytest.mark.parametrize("load_factor, drain_s", [(0.8, 60.0), (3.0, 0.0)])
def test_every_arrival_is_completed_or_in_flight_at_the_end_once(load_factor, drain_s):
    workload = make_workload(8, load_factor, 30.0, 0, SIZES, drain_s=drain_s)
    record = simulate(workload, "p2c_units")
    assert record.dispatched == record.completed + record.in_flight_at_end
    assert (record.replica_of[:record.dispatched] >= 0).all() and (record.replica_of[record.dispatched:] == -1).all()
    finished = np.isfinite(record.finish_ms)
    assert (record.replica_of[finished] >= 0).all()  # only what was sent can finish
    demand = workload.model.demand_ms(workload.input_tokens, workload.output_tokens)
    on_slow = np.where(record.replica_of == 0, 3.0, 1.0)
    assert (record.finish_ms[finished] - workload.arrival_ms[finished]
            >= demand[finished] * on_slow[finished] - 1e-6).all()  # nobody runs faster than alone
    if load_factor < 1:
        assert summarize(workload, record).requests_unfinished == 0
    else:
        assert record.in_flight_at_end > 0  # overloaded and stopped at the horizon: the identity is not trivial


def test_the_same_seed_gives_the_same_result_and_another_seed_another():
    def run(seed):
        return compare(["p2c_units", "random"], [8], 0.8, 20.0, seed, SIZES)

    assert run(1) == run(1)
    assert [r.to_json() for r in run(1)] != [r.to_json() for r in run(2)]


def test_the_drain_does_not_change_the_requests_before_it():
    short, long = (make_workload(8, 0.8, 30.0, 4, SIZES, drain_s=drain_s) for drain_s in (0.0, 300.0))
    n = len(short.arrival_ms)
    assert len(long.arrival_ms) > 5 * n
    assert long.arrival_ms[:n].tolist() == short.arrival_ms.tolist()
    assert long.input_tokens[:n].tolist() == short.input_tokens.tolist()
    assert long.output_tokens[:n].tolist() == short.output_tokens.tolist()


def test_compare_runs_every_balancer_on_the_same_requests_per_replica_count():
    results = compare(["p2c_units", "round_robin", "random"], [4, 8], 0.8, 20.0, 0, SIZES)
    assert [(r.replicas, r.balancer) for r in results] == [
        (4, "p2c_units"), (4, "round_robin"), (4, "random"), (8, "p2c_units"), (8, "round_robin"), (8, "random")]
    for replicas in (4, 8):
        same = {(r.requests_measured, r.demand_p99_ms, r.arrival_rate_rps) for r in results if r.replicas == replicas}
        assert len(same) == 1
    assert results[3].arrival_rate_rps == pytest.approx(2 * results[0].arrival_rate_rps)


# -- what the balancers do with it --------------------------------------------------------------

@pytest.fixture(scope="module")
def sixteen_replicas_one_slowed():
    results = compare(["p2c_units", "round_robin"], [16], 0.8, 300.0, 11, SIZES, slow_factor=3.0)
    return {r.balancer: r for r in results}


def test_p2c_units_sends_the_slowed_replica_less_than_round_robin(sixteen_replicas_one_slowed):
    p2c, rr = sixteen_replicas_one_slowed["p2c_units"], sixteen_replicas_one_slowed["round_robin"]
    assert rr.slow_share == pytest.approx(1 / 16, abs=0.002)  # rotation: exactly its turn
    assert p2c.slow_share < 0.75 * rr.slow_share
    assert p2c.slow_fair_share == pytest.approx(1 / (1 + 15 * 3))


def test_p2c_units_p99_is_well_below_round_robins_at_moderate_load(sixteen_replicas_one_slowed):
    p2c, rr = sixteen_replicas_one_slowed["p2c_units"], sixteen_replicas_one_slowed["round_robin"]
    assert p2c.requests_measured > 1000
    assert p2c.p99_ms < 0.6 * rr.p99_ms
    assert p2c.in_flight_max_over_mean < rr.in_flight_max_over_mean


def test_with_equal_replicas_p2c_units_still_has_the_lower_p99():
    """Round robin spreads request counts evenly but not their demands; p2c_units looks at the demands."""
    p2c, rr = compare(["p2c_units", "round_robin"], [16], 0.8, 300.0, 11, SIZES, slow_factor=1.0)
    assert p2c.p99_ms < rr.p99_ms
    assert p2c.slow_share == pytest.approx(p2c.slow_fair_share, rel=0.2)  # nobody is slow: replica 0 gets 1/16


# -- inputs ------------------------------------------------------------------------------------

def test_read_sizes_counts_an_output_of_zero_as_one(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,374,44\n2023-11-16 18:15:50,396,0\n")
    inputs, outputs = read_sizes(trace)
    assert inputs.tolist() == [374, 396] and outputs.tolist() == [44, 1]


def test_read_sizes_names_the_missing_column(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,374\n")
    with pytest.raises(ValueError, match="lacks column.*GeneratedTokens"):
        read_sizes(trace)


@pytest.mark.parametrize("sizes", [([], []), ([1, 2], [3]), ([1, -2], [3, 4])])
def test_unusable_sizes_are_refused(sizes):
    with pytest.raises(ValueError):
        make_workload(4, 0.8, 10.0, 0, sizes)


def test_a_slow_factor_below_one_is_refused():
    with pytest.raises(ValueError, match="slow_factor"):
        simulate(fixed([0.0], [10.0]), "p2c_units", slow_factor=0.5)


def test_random_module_state_is_not_touched():
    random.seed(5)
    expected = random.random()
    random.seed(5)
    compare(["random", "p2c_units"], [4], 0.8, 10.0, 0, SIZES)
    assert random.random() == expected
