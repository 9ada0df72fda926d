"""Token-bucket rate limits: what is admitted when, atomicity across limits, exact Retry-After."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from serving.router.ratelimit import WAIT_TOLERANCE_S, Charge, Limiter

GEC_REQUESTS = ("endpoint_requests", "gec")
GEC_UNITS = ("endpoint_units", "gec")
TOKEN_REQUESTS = ("token_requests", "tok_1")


def charge(key=GEC_REQUESTS, rate_per_s=2.0, burst=2.0, amount=1.0) -> Charge:
    return Charge(key, rate_per_s, burst, amount)


@pytest.mark.parametrize("rate_per_s, burst, arrivals, expected", [
    # (now, amount) per request; expected: admitted or not, in order
    (2.0, 2.0, [(0.0, 1), (0.0, 1), (0.0, 1)], [True, True, False]),
    (2.0, 2.0, [(0.0, 1), (0.0, 1), (0.0, 1), (0.5, 1), (0.5, 1)], [True, True, False, True, False]),
    (2.0, 2.0, [(0.0, 2), (10.0, 1), (10.0, 1), (10.0, 1)], [True, True, True, False]),  # refills only to burst
    (1.0, 5.0, [(0.0, 5), (1.0, 2), (2.0, 2)], [True, False, True]),
    (10.0, 1.0, [(0.0, 1), (0.05, 1), (0.1, 1)], [True, False, True]),
    (1.0, 3.0, [(0.0, 0), (0.0, 3), (0.0, 0)], [True, True, True]),  # a zero charge always passes
])
def test_admits_what_the_bucket_holds(rate_per_s, burst, arrivals, expected):
    limiter = Limiter()
    admitted = [limiter.admit([charge(rate_per_s=rate_per_s, burst=burst, amount=amount)], now).admitted
                for now, amount in arrivals]
    assert admitted == expected


arrivals = st.lists(st.tuples(st.floats(0, 5), st.floats(0, 1)), max_size=60)


@given(rate_per_s=st.floats(0.1, 100), burst=st.floats(1, 50), gaps_and_fractions=arrivals)
def test_no_window_admits_more_than_rate_times_length_plus_burst(rate_per_s, burst, gaps_and_fractions):
    limiter, now, admitted = Limiter(), 100.0, []
    for gap_s, fraction in gaps_and_fractions:
        now += gap_s
        amount = fraction * burst
        if limiter.admit([charge(rate_per_s=rate_per_s, burst=burst, amount=amount)], now).admitted:
            admitted.append((now, amount))
    slack = rate_per_s * WAIT_TOLERANCE_S + 1e-9 * burst
    for i, (t0, _) in enumerate(admitted):
        total = 0.0
        for t1, amount in admitted[i:]:
            total += amount
            assert total <= rate_per_s * (t1 - t0) + burst + slack


def test_a_refusal_by_one_limit_charges_no_other():
    limiter = Limiter()
    endpoint = charge(GEC_REQUESTS, rate_per_s=100.0, burst=100.0)
    token = charge(TOKEN_REQUESTS, rate_per_s=1.0, burst=1.0)
    assert limiter.admit([endpoint, token], 0.0).admitted
    before = copy.deepcopy(limiter.bucket(GEC_REQUESTS))
    decision = limiter.admit([endpoint, token], 0.0)
    assert not decision.admitted and decision.limit == "token tok_1: 1 requests/s"
    assert limiter.bucket(GEC_REQUESTS) == before
    assert limiter.admit([endpoint], 0.0).admitted  # the endpoint still had its 99 tokens


@given(steps=st.lists(st.tuples(st.floats(0, 2), st.floats(0, 1), st.floats(0, 1)), max_size=50))
def test_every_bucket_is_charged_or_none_is(steps):
    limiter, now, keys = Limiter(), 0.0, (GEC_REQUESTS, GEC_UNITS)
    for gap_s, request_fraction, unit_fraction in steps:
        now += gap_s
        charges = [charge(GEC_REQUESTS, rate_per_s=3.0, burst=3.0, amount=3.0 * request_fraction),
                   charge(GEC_UNITS, rate_per_s=0.5, burst=2.0, amount=2.0 * unit_fraction)]
        before = {key: copy.deepcopy(limiter.bucket(key)) for key in keys}  # None: not made yet, i.e. full
        decision = limiter.admit(charges, now)
        for c in charges:
            bucket = before[c.bucket_key]
            level_before = c.burst if bucket is None else bucket.tokens_at(now)
            if decision.admitted:
                assert limiter.bucket(c.bucket_key).tokens_at(now) == pytest.approx(level_before - c.amount, abs=1e-9)
            else:
                assert limiter.bucket(c.bucket_key).tokens_at(now) == level_before


@given(rate_per_s=st.floats(0.1, 1000), burst=st.floats(1, 100), drained=st.floats(0, 1), wanted=st.floats(0, 1),
       start_s=st.floats(0, 1e6))
# About half the draws are admitted and discarded by the assume below; on some seeds the edge values
# Hypothesis favours discard more, and its filter health check failed the test (seen once, 2026-12-07).
@settings(max_examples=300, suppress_health_check=[HealthCheck.filter_too_much])
def test_retry_after_is_the_exact_wait(rate_per_s, burst, drained, wanted, start_s):
    limiter = Limiter()
    assert limiter.admit([charge(rate_per_s=rate_per_s, burst=burst, amount=drained * burst)], start_s).admitted
    wanted_charge = charge(rate_per_s=rate_per_s, burst=burst, amount=wanted * burst)
    decision = limiter.admit([wanted_charge], start_s)
    assume(not decision.admitted and decision.retry_after_s > 1e-3)
    assert decision.retry_after_s == pytest.approx((wanted - (1 - drained)) * burst / rate_per_s)
    too_early, on_time = copy.deepcopy(limiter), copy.deepcopy(limiter)
    assert not too_early.admit([wanted_charge], start_s + decision.retry_after_s - 1e-3).admitted
    assert on_time.admit([wanted_charge], start_s + decision.retry_after_s).admitted


def test_retry_after_waits_for_every_refusing_limit():
    limiter = Limiter()
    requests, units = charge(GEC_REQUESTS, rate_per_s=2.0, burst=1.0), charge(GEC_UNITS, rate_per_s=0.25, burst=1.0)
    assert limiter.admit([requests, units], 0.0).admitted
    decision = limiter.admit([requests, units], 0.0)
    assert (decision.retry_after_s, decision.limit) == (4.0, "endpoint gec: 0.25 model units/s")
    assert not limiter.admit([requests, units], 3.9).admitted
    assert limiter.admit([requests, units], 4.0).admitted


@pytest.mark.parametrize("wait_s, header", [(0.5, "1"), (1.0, "1"), (1.2, "2"), (4.0, "4")])
def test_a_refusal_is_a_429_with_retry_after_in_whole_seconds_rounded_up(wait_s, header):
    limiter, burst = Limiter(), max(wait_s, 1.0)
    assert limiter.admit([charge(rate_per_s=1.0, burst=burst, amount=burst)], 0.0).admitted  # empty now
    decision = limiter.admit([charge(rate_per_s=1.0, burst=burst, amount=wait_s)], 0.0)
    error = decision.error()
    assert decision.retry_after_s == pytest.approx(wait_s)
    assert error.status == 429 and error.headers == {"Retry-After": header}
    assert "endpoint gec: 1 requests/s" in str(error) and f"retry after {header} s" in str(error)


def test_a_charge_above_the_burst_is_never_admitted_and_says_so():
    limiter = Limiter()
    units = charge(GEC_UNITS, rate_per_s=10.0, burst=8.0, amount=12.0)
    for now in (0.0, 1e6):
        decision = limiter.admit([units, charge(TOKEN_REQUESTS)], now)
        assert not decision.admitted and decision.never and decision.retry_after_s == 0.0
    error = decision.error()
    assert error.status == 413 and "Retry-After" not in error.headers
    assert "costs 12 model units" in str(error) and "at most 8 at once" in str(error)
    assert limiter.bucket(TOKEN_REQUESTS) is None  # nothing was charged


def test_an_edited_limit_is_adopted_by_its_bucket_with_tokens_capped_at_the_new_burst():
    limiter = Limiter()
    assert limiter.admit([charge(rate_per_s=1.0, burst=10.0, amount=2.0)], 0.0).admitted  # 8 left
    assert limiter.admit([charge(rate_per_s=4.0, burst=5.0, amount=0.0)], 0.0).admitted  # edited: 5 left
    assert limiter.bucket(GEC_REQUESTS).tokens_at(0.0) == 5.0
    decision = limiter.admit([charge(rate_per_s=4.0, burst=5.0, amount=5.0)], 0.0)
    assert decision.admitted
    decision = limiter.admit([charge(rate_per_s=4.0, burst=5.0, amount=2.0)], 0.0)
    assert decision.retry_after_s == 0.5 and decision.limit == "endpoint gec: 4 requests/s"  # the new rate


def test_buckets_full_again_are_evicted_and_busy_ones_kept():
    def token(name, rate_per_s=1.0):
        return charge(("token_requests", name), rate_per_s=rate_per_s, burst=1.0)

    limiter = Limiter(max_buckets=10)
    for i in range(10):
        assert limiter.admit([token(f"t{i}")], 0.0).admitted
    assert limiter.admit([token("busy", rate_per_s=0.01)], 0.5).admitted
    assert len(limiter) == 11  # swept at 10, but at t=0.5 none was full: the next sweep waits for 20
    for i in range(10):
        assert limiter.admit([token(f"late{i}")], 2.0).admitted
    assert len(limiter) == 11  # t0..t9 were full again and went; "busy" and late0..late8 still owe
    assert limiter.bucket(("token_requests", "t0")) is None and limiter.bucket(("token_requests", "busy"))
    assert not limiter.admit([token("busy", rate_per_s=0.01)], 2.0).admitted


@pytest.mark.parametrize("rate_per_s, burst, amount", [(0.0, 1.0, 1.0), (1.0, 0.0, 0.0), (1.0, 1.0, -1.0)])
def test_a_limit_without_a_rate_or_a_burst_is_refused_at_construction(rate_per_s, burst, amount):
    with pytest.raises(ValueError):
        Charge(GEC_REQUESTS, rate_per_s, burst, amount)
