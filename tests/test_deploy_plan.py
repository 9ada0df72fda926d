"""The registry sensor's decisions, as pure functions of (endpoints, runs, cursor, now): every
endpoint converges to what its alias names, forward and back, without interleaving or looping."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipelines.deploy_plan import (MAX_ATTEMPTS, Attempt, EndpointView, Lookups, RunView, SensorCursor,
                                   lookups_for_tick, plan_tick)

WATCHED = [("gec", "champion"), ("iris", "champion")]
KNOWN = {"gec@champion": "1", "iris@champion": "1"}


@pytest.mark.parametrize(
    "last_poll_s, now_s, inbox_models, expected_pairs, polled",
    [
        (None, 0.0, [], WATCHED, True),  # first tick polls everything
        (100.0, 110.0, [], [], False),  # between polls, no webhook: nothing to look up
        (100.0, 110.0, ["gec"], [("gec", "champion")], False),  # a webhook for gec: look up gec now
        (100.0, 110.0, ["unwatched"], [], False),  # a webhook for a model no spec serves
        (100.0, 130.0, [], WATCHED, True),  # poll interval (30 s) elapsed
    ],
)
def test_lookups_follow_webhooks_and_poll_on_schedule(last_poll_s, now_s, inbox_models, expected_pairs, polled):
    lookups = lookups_for_tick(WATCHED, inbox_models, SensorCursor(last_poll_s=last_poll_s, resolved=KNOWN), now_s)
    assert lookups == Lookups(pairs=tuple(expected_pairs), polled=polled)


def test_an_alias_never_resolved_is_looked_up_before_the_next_poll():
    lookups = lookups_for_tick(WATCHED + [("new", "champion")], [], SensorCursor(100.0, KNOWN), now_s=110.0)
    assert lookups.pairs == (("new", "champion"),)


def view(name="gec", desired="2", serving=None, model="gec", reusable=False, sections="s1", rolled_back=None):
    return EndpointView(name, model, desired, serving, sections, reusable, rolled_back)


def test_an_endpoint_serving_what_its_alias_names_needs_nothing():
    plan = plan_tick([view(desired="2", serving="gec.v2")], {}, set(), SensorCursor(), 0.0)
    assert plan.deploys == [] and plan.cursor.attempts == {}


@pytest.mark.parametrize("serving", [None, "gec.v3"])  # a new endpoint, and an alias moved back from v3
def test_an_endpoint_whose_alias_names_another_version_gets_a_deploy(serving):
    plan = plan_tick([view(desired="2", serving=serving)], {}, set(), SensorCursor(), 0.0)
    [deploy] = plan.deploys
    assert (deploy.partition, deploy.endpoints, deploy.run_key) == ("gec.v2", ("gec",), "gec.v2#1")


def test_a_version_already_built_under_the_same_spec_is_only_rolled_out():
    plan = plan_tick([view(desired="2", serving="gec.v3", reusable=True)], {}, set(), SensorCursor(), 0.0)
    assert plan.deploys[0].reuse


def test_two_endpoints_wanting_one_version_share_one_run():
    plan = plan_tick([view("a"), view("b"), view("c", desired="3")], {}, set(), SensorCursor(), 0.0)
    assert [(d.partition, d.endpoints) for d in plan.deploys] == [("gec.v2", ("a", "b")), ("gec.v3", ("c",))]


def test_nothing_is_asked_while_a_run_of_the_model_is_in_flight():
    assert plan_tick([view()], {}, {"gec"}, SensorCursor(), 0.0).deploys == []


def tick_until_quiet(outcome: str, ticks: int = 10, refused: bool = False):
    """Tick with every requested run ending in ``outcome``; returns the requests made."""
    cursor, requested = SensorCursor(), []
    for tick in range(ticks):
        runs = {key: RunView(outcome, refused) for a in cursor.attempts.values() for key in a.run_keys}
        plan = plan_tick([view()], runs, set(), cursor, float(tick))
        requested += [d.run_key for d in plan.deploys]
        cursor = plan.cursor
    return requested, plan


def test_a_failed_deploy_is_tried_again_a_bounded_number_of_times():
    requested, plan = tick_until_quiet("failure")
    assert len(requested) == MAX_ATTEMPTS
    assert "failed; not trying again" in plan.notes[0]


def test_a_version_rolled_back_after_its_bake_is_not_deployed_again_on_that_endpoint():
    plan = plan_tick([view(serving="gec.v1", rolled_back="20.0% server errors in its first 60 s"),
                      view(name="gec-canary", serving="gec.v1")], {}, set(), SensorCursor(), now_s=0.0)
    assert [d.endpoints for d in plan.deploys] == [("gec-canary",)]  # the other endpoint still wants it
    assert plan.notes == ["gec: gec.v2 was rolled back (20.0% server errors in its first 60 s); it keeps its "
                          "current revision until the alias names another version"]


def test_a_version_the_gate_refused_is_not_tried_again():
    requested, plan = tick_until_quiet("failure", refused=True)
    assert len(requested) == 1 and "eval gate refused gec.v2" in plan.notes[0]


def test_a_requested_run_is_waited_for_and_one_that_never_shows_up_counts_as_failed():
    cursor = plan_tick([view()], {}, set(), SensorCursor(), 0.0).cursor
    [key] = cursor.attempts["gec"].run_keys
    assert plan_tick([view()], {key: RunView(None)}, set(), cursor, 10.0).deploys == []  # not created yet
    assert plan_tick([view()], {key: RunView("in_flight")}, set(), cursor, 1000.0).deploys == []
    later = plan_tick([view()], {key: RunView(None)}, set(), cursor, 1000.0)  # lost after 300 s
    assert [d.run_key for d in later.deploys] == ["gec.v2#2"]


@pytest.mark.parametrize("change", ["alias", "spec"])
def test_moving_the_alias_or_changing_the_spec_starts_a_fresh_attempt(change):
    _, plan = tick_until_quiet("failure")
    changed = view(desired="3") if change == "alias" else view(sections="s2")
    runs = {key: RunView("failure") for a in plan.cursor.attempts.values() for key in a.run_keys}
    assert len(plan_tick([changed], runs, set(), plan.cursor, 99.0).deploys) == 1


def test_the_cursor_round_trips_through_json():
    cursor = SensorCursor(12.5, {"gec@champion": "3", "x@y": None}, {"gec": Attempt("gec.v3", 1.0, ("gec.v3#4",),
                                                                                  2.0, "s1")}, 4)
    assert SensorCursor.parse(cursor.dump()) == cursor


@given(st.lists(st.tuples(st.sampled_from(["1", "2", "3"]), st.sampled_from([None, "gec.v1", "gec.v2", "gec.v3"]),
                          st.sampled_from(["success", "failure", "in_flight", None])), min_size=1, max_size=30))
def test_at_most_one_run_per_model_is_ever_outstanding(ticks):
    """Each tick the outstanding run either stays in flight or ends as drawn; the alias and the
    traffic move as drawn. The sensor never asks for a second run while one is in flight."""
    cursor = SensorCursor()
    outstanding = set()
    for now, (desired, serving, outcome) in enumerate(ticks):
        if outcome != "in_flight":
            outstanding = set()  # the run asked for last ended (or was never created and is lost)
        runs = {key: RunView("in_flight" if key in outstanding else outcome) for a in cursor.attempts.values()
                for key in a.run_keys}
        in_flight = {"gec"} if outstanding else set()
        plan = plan_tick([view(desired=desired, serving=serving)], runs, in_flight, cursor, float(now) * 400)
        assert len(plan.deploys) <= 1
        if plan.deploys:
            assert not outstanding  # never a second run while one asked for is in flight
            outstanding = {plan.deploys[0].run_key}
        cursor = plan.cursor
