"""The registry sensor's decisions, as pure functions of (specs, inbox, cursor, now)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipelines.deploy_plan import Lookups, SensorCursor, advance, lookups_for_tick, new_deploys

WATCHED = [("gec", "champion"), ("iris", "champion")]


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
    lookups = lookups_for_tick(WATCHED, inbox_models, SensorCursor(last_poll_s=last_poll_s), now_s)
    assert lookups == Lookups(pairs=tuple(expected_pairs), polled=polled)


def test_a_version_is_requested_once_even_when_the_alias_moves_back():
    cursor = SensorCursor()
    history = []
    for tick, version in enumerate(["1", "2", "1", "2", "3"]):
        lookups = Lookups(pairs=(("gec", "champion"),), polled=True)
        keys = new_deploys({("gec", "champion"): version}, cursor.requested)
        cursor = advance(cursor, lookups, keys, now_s=float(tick))
        history.append(keys)
    assert history == [["gec.v1"], ["gec.v2"], [], [], ["gec.v3"]]


def test_cursor_round_trips_through_json():
    cursor = SensorCursor(last_poll_s=12.5, requested=frozenset({"gec.v1", "iris.v2"}))
    assert SensorCursor.parse(cursor.dump()) == cursor
    assert SensorCursor.parse(None) == SensorCursor() == SensorCursor.parse("")


def test_a_lookup_only_tick_keeps_the_poll_time():
    cursor = SensorCursor(last_poll_s=100.0)
    after = advance(cursor, Lookups(pairs=(), polled=False), [], now_s=110.0)
    assert after.last_poll_s == 100.0


versions = st.dictionaries(
    st.tuples(st.sampled_from(["gec", "iris", "tiny"]), st.sampled_from(["champion", "canary"])),
    st.one_of(st.none(), st.integers(1, 20).map(str)),
)


@given(st.lists(versions, min_size=1, max_size=12))
def test_no_partition_is_ever_requested_twice(ticks):
    cursor, requested = SensorCursor(), []
    for resolved in ticks:
        keys = new_deploys(resolved, cursor.requested)
        requested += keys
        cursor = advance(cursor, Lookups(pairs=tuple(resolved), polled=True), keys, now_s=0.0)
    assert len(requested) == len(set(requested))
    seen = {f"{m}.v{v}" for tick in ticks for (m, _), v in tick.items() if v is not None}
    assert set(requested) == seen
