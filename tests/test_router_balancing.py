"""The router's balancing plugins (serving/router/balancing): filter → score → pick, on snapshots, no I/O."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.router.balancing import BALANCERS, DEFAULT_BALANCER, Balancer, Snapshot, make_balancer
from serving.router.balancing.least_loaded import LeastLoaded
from serving.router.balancing.not_ejected import not_ejected
from serving.router.balancing.p2c import PowerOfTwoChoices, draw_two
from serving.router.balancing.random_pick import RandomPick
from serving.router.balancing.requests import RequestsInFlight
from serving.router.balancing.round_robin import RoundRobin
from serving.router.balancing.units import UnitsInFlight


def snapshot(units=None, requests=None, ejected=(), cost=1.0) -> Snapshot:
    return Snapshot(units=units or {}, requests=requests or {}, ejected=frozenset(ejected), cost=cost)


class ScriptedRandom(random.Random):
    """``random()`` returns the given values in turn: the test decides what is drawn."""

    def __init__(self, values):
        super().__init__(0)
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


# --- filters ---------------------------------------------------------------------------------

@pytest.mark.parametrize("candidates, ejected, expected", [
    (["a", "b", "c"], {"b"}, ["a", "c"]),
    (["a", "b", "c"], set(), ["a", "b", "c"]),
    (["a", "b"], {"a", "b"}, []),  # the filter itself drops all; the Balancer then keeps them
    (["a"], {"z"}, ["a"]),         # ejected URLs of other endpoints do not matter
])
def test_not_ejected_drops_exactly_the_ejected_replicas(candidates, ejected, expected):
    assert list(not_ejected(candidates, snapshot(ejected=ejected))) == expected


def test_not_ejected_copies_nothing_when_nothing_is_ejected():
    candidates = ["a", "b"]
    assert not_ejected(candidates, snapshot()) is candidates


# --- scorers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("units, expected", [(None, 1.0), (0.0, 1.0), (1.0, 0.5), (3.0, 0.25), (9.0, 0.1),
                                             (-1e-12, 1.0)])  # float drift below zero counts as idle
def test_units_score_is_one_over_one_plus_units_in_flight(units, expected):
    state = snapshot(units={} if units is None else {"a": units})
    assert UnitsInFlight().score("a", state) == pytest.approx(expected)


@pytest.mark.parametrize("requests, expected", [(None, 1.0), (0, 1.0), (1, 0.5), (4, 0.2), (99, 0.01)])
def test_requests_score_is_one_over_one_plus_requests_in_flight(requests, expected):
    state = snapshot(requests={} if requests is None else {"a": requests})
    assert RequestsInFlight().score("a", state) == pytest.approx(expected)


@given(st.floats(min_value=0, max_value=1e12), st.integers(min_value=0, max_value=10**9))
def test_every_score_lies_in_zero_one(units, requests):
    state = snapshot(units={"a": units}, requests={"a": requests})
    assert 0.0 < UnitsInFlight().score("a", state) <= 1.0
    assert 0.0 < RequestsInFlight().score("a", state) <= 1.0


# --- pickers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("values, n, expected", [
    ((0.0, 0.0), 3, (0, 1)),    # the second draw skips the first index
    ((0.9, 0.6), 3, (2, 1)),
    ((0.5, 0.5), 2, (1, 0)),
    ((0.999, 0.999), 4, (3, 2)),
])
def test_draw_two_gives_two_distinct_indices(values, n, expected):
    assert draw_two(n, ScriptedRandom(values)) == expected


def test_draw_two_is_uniform_over_ordered_pairs():
    rng = random.Random(11)
    counts = Counter(draw_two(4, rng) for _ in range(12_000))
    assert set(counts) == {(i, j) for i in range(4) for j in range(4) if i != j}
    assert all(800 < count < 1200 for count in counts.values()), counts  # 1,000 expected each


@pytest.mark.parametrize("scores, draws, expected", [
    ({"a": 0.25, "b": 1.0, "c": 1 / 6}, (0.9, 0.6), "b"),  # draws (c, b): b scores higher
    ({"a": 0.25, "b": 1.0, "c": 1 / 6}, (0.0, 0.9), "a"),  # draws (a, c)
    ({"a": 0.5, "b": 0.5, "c": 0.5}, (0.9, 0.6), "c"),     # tie: the first drawn
    ({"a": 0.5, "b": 0.5, "c": 0.5}, (0.0, 0.0), "a"),
])
def test_p2c_takes_the_higher_score_of_its_two_draws(scores, draws, expected):
    assert PowerOfTwoChoices().pick(["a", "b", "c"], scores.get, ScriptedRandom(draws)) == expected


def test_p2c_never_sends_to_the_worst_of_three_and_the_best_gets_two_thirds():
    rng = random.Random(5)
    scores = {"a": 0.1, "b": 0.5, "c": 0.9}
    picks = Counter(PowerOfTwoChoices().pick(["a", "b", "c"], scores.get, rng) for _ in range(3000))
    assert picks["a"] == 0
    assert 0.62 < picks["c"] / 3000 < 0.72


def test_p2c_draws_two_distinct_replicas_so_of_two_the_better_always_wins():
    rng = random.Random(1)
    assert {PowerOfTwoChoices().pick(["a", "b"], {"a": 0.2, "b": 0.9}.get, rng) for _ in range(200)} == {"b"}


@pytest.mark.parametrize("scores, expected", [
    ({"a": 0.25, "b": 1.0, "c": 0.5}, {"b"}),
    ({"a": 0.25, "b": 1.0, "c": 1.0}, {"b", "c"}),
    ({"a": 0.0, "b": 0.0, "c": 0.0}, {"a", "b", "c"}),
])
def test_least_loaded_takes_the_best_score_over_all_and_spreads_ties(scores, expected):
    rng = random.Random(3)
    picks = Counter(LeastLoaded().pick(list(scores), scores.get, rng) for _ in range(3000))
    assert set(picks) == expected
    assert all(abs(count / 3000 - 1 / len(expected)) < 0.05 for count in picks.values()), picks


@pytest.mark.parametrize("candidates, start, expected", [
    (["a", "b", "c"], 0, ["a", "b", "c", "a", "b"]),
    (["a", "b", "c"], 2, ["c", "a", "b"]),
    (["a", "b"], 7, ["b", "a", "b"]),  # a position from a longer list wraps onto this one
    (["only"], 0, ["only", "only"]),
])
def test_round_robin_rotates_from_its_position(candidates, start, expected):
    picker = RoundRobin(next_index=start)
    assert [picker.pick(candidates, None, random.Random(0)) for _ in expected] == expected


def test_round_robin_state_belongs_to_one_picker():
    first, second = RoundRobin(), RoundRobin()
    first.pick(["a", "b"], None, random.Random(0))
    assert second.pick(["a", "b"], None, random.Random(0)) == "a"
    assert first.next_index == 1 and second.next_index == 1


def test_random_pick_is_uniform():
    rng = random.Random(2)
    picks = Counter(RandomPick().pick(["a", "b", "c", "d"], None, rng) for _ in range(8000))
    assert set(picks) == {"a", "b", "c", "d"}
    assert all(1800 < count < 2200 for count in picks.values()), picks


# --- the balancer ----------------------------------------------------------------------------

class CountingScorer:
    def __init__(self, value=0.5):
        self.value, self.calls = value, 0

    def score(self, url, state):
        self.calls += 1
        return self.value


def test_p2c_scores_only_its_two_draws_per_request():
    scorer = CountingScorer()
    balancer = Balancer("counted", [not_ejected], [(scorer, 1.0)], PowerOfTwoChoices())
    candidates = [f"r{i}" for i in range(100)]
    for _ in range(10):
        balancer.pick(candidates, snapshot(), random.Random(0))
    assert scorer.calls == 20


def test_one_candidate_is_returned_without_filtering_or_scoring():
    scorer = CountingScorer()
    balancer = Balancer("counted", [not_ejected], [(scorer, 1.0)], PowerOfTwoChoices())
    assert balancer.pick(["a"], snapshot(ejected={"a"}), random.Random(0)) == "a"
    assert scorer.calls == 0


@pytest.mark.parametrize("name", sorted(BALANCERS))
def test_when_every_replica_is_ejected_a_balancer_still_picks_one(name):
    picks = {make_balancer(name).pick(["a", "b"], snapshot(ejected={"a", "b"}), random.Random(seed))
             for seed in range(20)}
    assert picks and picks <= {"a", "b"}


def test_the_combined_score_is_the_weighted_mean():
    balancer = Balancer("mixed", [], [(UnitsInFlight(), 3.0), (RequestsInFlight(), 1.0)], LeastLoaded())
    state = snapshot(units={"a": 1.0}, requests={"a": 4})  # units score 0.5, requests score 0.2
    assert balancer.score("a", state) == pytest.approx((3 * 0.5 + 1 * 0.2) / 4)
    assert balancer.pick(["a", "b"], state, random.Random(0)) == "b"  # b scores 1.0


@pytest.mark.parametrize("scorers", [[(UnitsInFlight(), 0.0)], [(UnitsInFlight(), -1.0)]])
def test_scorer_weights_must_be_positive(scorers):
    with pytest.raises(ValueError, match="> 0"):
        Balancer("bad", [], scorers, LeastLoaded())


def test_no_candidates_is_an_error_not_a_guess():
    with pytest.raises(ValueError, match="no candidates"):
        make_balancer().pick([], snapshot(), random.Random(0))


@pytest.mark.parametrize("name, units, requests, expected", [
    ("p2c_units", {"a": 9.0}, {"b": 9}, "b"),        # two candidates: both drawn, fewer units wins
    ("p2c_requests", {"a": 9.0}, {"b": 9}, "a"),     # counts requests, not units
    ("least_loaded", {"a": 2.0, "b": 1.0, "c": 3.0}, {}, "b"),
])
def test_each_balancer_ranks_on_its_own_signal(name, units, requests, expected):
    candidates = sorted(set(units) | set(requests))
    assert make_balancer(name).pick(candidates, snapshot(units, requests), random.Random(4)) == expected


def test_make_balancer_names_the_known_ones_and_returns_fresh_objects():
    assert DEFAULT_BALANCER == "p2c_units" and make_balancer().name == "p2c_units"
    assert set(BALANCERS) == {"p2c_units", "p2c_requests", "least_loaded", "round_robin", "random"}
    assert make_balancer("round_robin").picker is not make_balancer("round_robin").picker
    with pytest.raises(ValueError, match="least_loaded, p2c_requests, p2c_units, random, round_robin"):
        make_balancer("fastest")


# --- properties ------------------------------------------------------------------------------

URLS = [f"http://r{i}" for i in range(8)]
# Quarter units: 1/(1 + units) cannot tell 0 from 5e-324, and the router never counts that finely.
loads = st.dictionaries(st.sampled_from(URLS), st.integers(0, 400).map(lambda quarters: quarters / 4), max_size=8)
counts = st.dictionaries(st.sampled_from(URLS), st.integers(min_value=0, max_value=100), max_size=8)


@given(name=st.sampled_from(sorted(BALANCERS)), candidates=st.lists(st.sampled_from(URLS), min_size=1, unique=True),
       ejected=st.sets(st.sampled_from(URLS)), units=loads, requests=counts, seed=st.integers(0, 2**32 - 1))
def test_no_balancer_picks_outside_the_candidates_or_an_ejected_replica_while_another_exists(
        name, candidates, ejected, units, requests, seed):
    rng = random.Random(seed)
    balancer = make_balancer(name)
    for _ in range(5):  # round robin moves on each pick
        url = balancer.pick(candidates, snapshot(units, requests, ejected), rng)
        assert url in candidates
        if any(c not in ejected for c in candidates):
            assert url not in ejected


@given(candidates=st.lists(st.sampled_from(URLS), min_size=2, unique=True), units=loads,
       seed=st.integers(0, 2**32 - 1))
def test_p2c_never_picks_the_single_most_loaded_replica(candidates, units, seed):
    heaviest = max(candidates, key=lambda url: units.get(url, 0.0))
    others = [units.get(url, 0.0) for url in candidates if url != heaviest]
    if max(others) >= units.get(heaviest, 0.0):
        return  # no single most loaded replica
    assert make_balancer("p2c_units").pick(candidates, snapshot(units), random.Random(seed)) != heaviest


@given(candidates=st.lists(st.sampled_from(URLS), min_size=1, unique=True), units=loads,
       seed=st.integers(0, 2**32 - 1))
def test_least_loaded_picks_a_replica_with_the_fewest_units(candidates, units, seed):
    url = make_balancer("least_loaded").pick(candidates, snapshot(units), random.Random(seed))
    assert units.get(url, 0.0) == min(units.get(c, 0.0) for c in candidates)


@given(candidates=st.lists(st.sampled_from(URLS), min_size=1, unique=True), start=st.integers(0, 10**6))
def test_round_robin_visits_every_candidate_once_per_cycle(candidates, start):
    picker = RoundRobin(next_index=start)
    cycle = [picker.pick(candidates, None, random.Random(0)) for _ in candidates]
    assert sorted(cycle) == sorted(candidates)
