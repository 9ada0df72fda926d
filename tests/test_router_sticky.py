"""Sticky routing with bounded load (serving/router/balancing/sticky.py) and its keys (keys.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.router.balancing import Snapshot, make_balancer
from serving.router.balancing.keys import MAX_KEY_CHARS, prefix_key, session_key
from serving.router.balancing.sticky import HashRing, bounded_pick, ring_for, stable_hash

URLS = [f"http://replica-{i}:8000" for i in range(8)]


def home_of(ring: HashRing, wanted: str) -> str:
    """A key whose home on ``ring`` is ``wanted``."""
    return next(key for key in (f"k{i}" for i in range(10_000)) if ring.home(key) == wanted)


# --- the ring --------------------------------------------------------------------------------

def test_the_hash_is_the_same_in_every_process():
    # Pinned: Python's hash() of a str changes with PYTHONHASHSEED, and several routers must agree.
    assert stable_hash("session-1") == 0xAE49BD2CD463E7AC
    assert HashRing(URLS).home("session-1") == HashRing(list(reversed(URLS))).home("session-1")


@pytest.mark.parametrize("urls, vnodes, message", [([], 160, "at least one"), (["a"], 0, "vnodes")])
def test_a_ring_needs_replicas_and_points(urls, vnodes, message):
    with pytest.raises(ValueError, match=message):
        HashRing(urls, vnodes)


def test_keys_spread_over_every_replica_within_half_to_one_and_a_half_of_their_share():
    ring = HashRing(URLS)
    homes = Counter(ring.home(f"session-{i}") for i in range(40_000))
    assert set(homes) == set(URLS)
    assert all(2_500 < count < 7_500 for count in homes.values()), homes  # 5,000 each on average


def test_ring_for_builds_each_replica_set_once():
    assert ring_for(tuple(URLS)) is ring_for(tuple(URLS))
    assert ring_for(tuple(URLS[:3])) is not ring_for(tuple(URLS))


@given(urls=st.permutations(URLS), keys=st.lists(st.text(max_size=30), min_size=1, max_size=50))
def test_the_same_key_has_the_same_home_whatever_the_order_of_the_replicas(urls, keys):
    ring, shuffled = HashRing(URLS), HashRing(urls)
    assert [ring.home(key) for key in keys] == [shuffled.home(key) for key in keys]


@given(removed=st.sampled_from(URLS), keys=st.lists(st.text(max_size=30), min_size=1, max_size=200))
def test_removing_a_replica_moves_only_the_keys_it_was_home_to(removed, keys):
    before, after = HashRing(URLS), HashRing([url for url in URLS if url != removed])
    for key in keys:
        if before.home(key) != removed:
            assert after.home(key) == before.home(key)
        else:
            assert after.home(key) != removed


# --- bounded load ----------------------------------------------------------------------------

RING4 = HashRing(["a", "b", "c", "d"])
HOME_A, HOME_B = home_of(RING4, "a"), home_of(RING4, "b")


@pytest.mark.parametrize("key, units, ejected, cost, load_factor, home, allowed", [
    # bound = 1.25 · (8 + 2) / 4 = 3.125
    (HOME_B, {"a": 6.0, "b": 2.0}, (), 2.0, 1.25, True, {"b"}),
    (HOME_A, {"a": 6.0, "b": 2.0}, (), 2.0, 1.25, False, {"b", "c", "d"}),
    (HOME_A, {"a": 2.5, "b": 2.0}, (), 3.5, 1.25, True, {"a"}),                  # at the bound 1.25 · 8 / 4
    (HOME_A, {}, (), 1.0, 1.0, True, {"a"}),                                     # idle: home, even at c = 1
    (HOME_A, {}, {"a"}, 1.0, 1.25, False, {"b", "c", "d"}),                      # ejected: never home
    (HOME_A, {"a": 1.0, "b": 9.0, "c": 9.0}, {"d"}, 1.0, 1.0, True, {"a"}),      # mean over b, c, a: (19 + 1) / 3
    (HOME_A, {"a": 10.0, "b": 10.0, "c": 10.0}, (), 1.0, 1.0, False, {"d"}),     # bound 7.75: only d is within
    (HOME_A, {"a": 10.0, "b": 6.0, "c": 8.0}, (), 1.0, 1.0, False, {"b", "d"}),  # bound 25 / 4 = 6.25
])
def test_the_home_takes_the_request_unless_it_is_over_the_bound_or_ejected(key, units, ejected, cost, load_factor,
                                                                           home, allowed):
    state = Snapshot(units=units, requests={}, ejected=frozenset(ejected), cost=cost)
    # A random fallback shows the whole set of replicas within the bound (P2C would favour the idlest).
    picks = {bounded_pick(key, ["a", "b", "c", "d"], state, RING4, load_factor, make_balancer("random"),
                          random.Random(seed)) for seed in range(40)}
    assert {went_home for _, went_home in picks} == {home}
    assert {url for url, _ in picks} == allowed


def test_a_home_that_is_not_a_candidate_falls_back():
    state = Snapshot(units={}, requests={})
    assert bounded_pick(HOME_A, ["b", "c"], state, RING4, 1.25, make_balancer(), random.Random(0))[1] is False


def test_when_every_candidate_is_ejected_one_still_takes_the_request():
    state = Snapshot(units={}, requests={}, ejected=frozenset("abcd"))
    url, went_home = bounded_pick(HOME_A, ["a", "b"], state, RING4, 1.25, make_balancer(), random.Random(0))
    assert url in {"a", "b"} and not went_home


@pytest.mark.parametrize("load_factor, candidates, message", [(0.99, ["a"], "load_factor"), (1.25, [], "candidates")])
def test_bounded_pick_refuses_a_load_factor_below_one_and_no_candidates(load_factor, candidates, message):
    with pytest.raises(ValueError, match=message):
        bounded_pick("k", candidates, Snapshot(units={}, requests={}), RING4, load_factor, make_balancer(),
                     random.Random(0))


@given(candidates=st.lists(st.sampled_from(URLS), min_size=1, unique=True),
       units=st.dictionaries(st.sampled_from(URLS), st.floats(min_value=0, max_value=1_000)),
       ejected=st.sets(st.sampled_from(URLS)), cost=st.floats(min_value=0, max_value=100),
       load_factor=st.floats(min_value=1, max_value=3), key=st.text(max_size=20), seed=st.integers(0, 2**32 - 1))
def test_bounded_load_never_places_a_request_on_a_replica_over_its_bound(candidates, units, ejected, cost,
                                                                         load_factor, key, seed):
    state = Snapshot(units=units, requests={}, ejected=frozenset(ejected), cost=cost)
    ring = ring_for(tuple(URLS))
    url, went_home = bounded_pick(key, candidates, state, ring, load_factor, make_balancer(), random.Random(seed))
    eligible = [c for c in candidates if c not in ejected] or candidates
    bound = load_factor * (sum(units.get(c, 0.0) for c in eligible) + cost) / len(eligible)
    assert url in eligible
    assert units.get(url, 0.0) <= bound * (1 + 1e-9)
    assert went_home == (url == ring.home(key))
    home = ring.home(key)
    if home in eligible and home not in ejected and units.get(home, 0.0) <= bound:
        assert went_home  # a home within the bound is never passed over


# --- keys --------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers, header, expected", [
    ({"X-Session-Id": "abc"}, "X-Session-Id", "abc"),
    ({"x-session-id": "abc"}, "X-Session-Id", "abc"),  # any case
    ({"X-SESSION-ID": " abc "}, "x-session-id", "abc"),
    ({"X-Session-Id": ""}, "X-Session-Id", None),
    ({"X-Session-Id": "   "}, "X-Session-Id", None),
    ({"Other": "abc"}, "X-Session-Id", None),
    ({"X-Session-Id": "s" * 1000}, "X-Session-Id", "s" * MAX_KEY_CHARS),
])
def test_session_key_is_the_header_value_in_any_case_capped(headers, header, expected):
    assert session_key(headers, header) == expected


CHAT = {"messages": [{"role": "system", "content": "Fix grammar."},
                     {"role": "user", "content": [{"type": "text", "text": "he go"},
                                                  {"type": "image_url", "image_url": {"url": "x"}},
                                                  {"type": "text", "text": " home"}]}]}


@pytest.mark.parametrize("payload, prefix_chars, expected", [
    (CHAT, 1000, "system\nFix grammar.\nuser\nhe go home\n"),
    (CHAT, 8, "system\nF"),
    ({"messages": [{"role": "user", "content": None}]}, 100, "user\n\n"),
    ({"messages": []}, 100, None),
    ({"prompt": "hello world"}, 5, "hello"),
    ({"prompt": ""}, 5, None),
    ({"prompt": [101, 7, 42, 9]}, 3, "101,7,42"),
    ({"prompt": [101, 7]}, 5, "101,7"),
    ({"prompt": ["first prompt", "second"]}, 5, "first"),
    ({"prompt": []}, 5, None),
    ({"prompt": [[1, 2], [3]]}, 5, None),  # a batch of token lists: nothing one key could stand for
    ({"input": "x"}, 5, None),
    ("not a dict", 5, None),
])
def test_prefix_key_is_the_start_of_the_rendered_prompt_in_characters(payload, prefix_chars, expected):
    assert prefix_key(payload, prefix_chars) == expected


def test_a_long_conversation_shares_its_key_with_its_next_turn():
    turn = {"messages": [{"role": "system", "content": "s" * 500}, {"role": "user", "content": "one"}]}
    later = {"messages": turn["messages"] + [{"role": "assistant", "content": "two"},
                                             {"role": "user", "content": "three"}]}
    assert prefix_key(turn, 256) == prefix_key(later, 256)
    assert prefix_key(turn, 600) != prefix_key(later, 600)


def test_prefix_chars_must_be_positive():
    with pytest.raises(ValueError, match="prefix_chars"):
        prefix_key({"prompt": "x"}, 0)
