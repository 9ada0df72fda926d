"""Model-unit targets and the choice of replicas to remove."""

import pytest

from autoscale.units import reference_request_units, unit_target
from autoscale.victims import pick_victims
from serving.router.cost import RouteCost


def test_a_reference_request_costs_what_the_router_charges_for_it():
    cost = RouteCost(0.5, 20.0, 30.0, concurrency=4)
    assert reference_request_units(0.5, 20.0, 30.0, 4, 100, 10) == cost.units(100, 10) == 70.0


def test_a_replica_full_of_reference_requests_holds_exactly_the_unit_target():
    per_request = reference_request_units(0.5, 20.0, 30.0, 4, input_tokens=100, output_tokens=10)
    assert unit_target(4, per_request) == 4 * per_request == 280.0


@pytest.mark.parametrize("target_concurrency, units", [(0, 70.0), (4, 0.0), (-1, 70.0)])
def test_unit_target_rejects_a_zero_or_negative_input(target_concurrency, units):
    with pytest.raises(ValueError):
        unit_target(target_concurrency, units)


VICTIMS = {
    "the least busy go first": ({"a": 5.0, "b": 1.0, "c": 3.0}, 2, ["b", "c"]),
    "among equally idle ones the newest (highest id) goes first": ({"r-1": 0.0, "r-3": 0.0, "r-2": 0.0}, 2,
                                                                   ["r-3", "r-2"]),
    "a busier new replica stays": ({"r-1": 0.0, "r-9": 4.0}, 1, ["r-1"]),
    "no victims for a count of zero": ({"a": 1.0}, 0, []),
    "a count above the replicas names them all": ({"a": 1.0, "b": 0.0}, 5, ["b", "a"]),
}


@pytest.mark.parametrize("in_flight, count, victims", VICTIMS.values(), ids=VICTIMS.keys())
def test_pick_victims(in_flight, count, victims):
    assert pick_victims(in_flight, count) == victims


def test_the_choice_does_not_depend_on_the_order_replicas_are_listed():
    in_flight = {"r-4": 0.0, "r-1": 2.0, "r-3": 0.0, "r-2": 2.0}
    assert pick_victims(in_flight, 3) == pick_victims(dict(reversed(in_flight.items())), 3) == ["r-4", "r-3", "r-2"]
