"""The anchors: other systems' autoscalers at their defaults, run on in-flight series.

Time is the tick index: ``in_flight[t]`` is seen at ``t`` seconds. The fleet has no cold start
here: what a policy orders is ready at the next tick (``run``).
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoscale.sim.anchors import (RAY_SERVE_DEFAULT_TARGET_ONGOING_REQUESTS, AIBrixKPA, KnativeKPA, KubernetesHPA,
                                   RayServe, StaticPeak, aibrix_cooldown, pods_metric_replicas, view_at)


def run(policy, in_flight, initial):
    """The order at each tick; ready (and the order the policy sees) follow each order at once."""
    desired, orders = initial, []
    for t, value in enumerate(in_flight):
        desired = policy.decide(view_at(float(t), value, ready=desired, desired=desired))
        orders.append(desired)
    return orders


def changes(orders):
    """(tick, order) at the first tick and wherever the order changes."""
    return [(t, d) for t, d in enumerate(orders) if t == 0 or d != orders[t - 1]]


def steady(seconds, value):
    return [float(value)] * seconds


ANCHORS = {  # target 4 in flight per replica
    "hpa": lambda **bounds: KubernetesHPA(4, **bounds),
    "knative_kpa": lambda **bounds: KnativeKPA(4, **bounds),
    "ray_serve": lambda **bounds: RayServe(4, **bounds),
    "aibrix_kpa": lambda **bounds: AIBrixKPA(4, **bounds),
}


def anchor(name, initial, min_replicas=1, max_replicas=100):
    return ANCHORS[name](min_replicas=min_replicas, max_replicas=max_replicas, initial_replicas=initial)


def test_static_peak_orders_its_count_whatever_the_demand():
    policy = StaticPeak(12)
    assert run(policy, [0.0, 1000.0, 3.0], initial=12) == [12, 12, 12]
    assert policy.name == "static_peak"


CONSTANT_DEMAND = {
    # name: (anchor, initial, in flight, expected order after 900 s)
    "hpa: ceil(37 / 4) = 10": ("hpa", 1, 37, 10),
    "hpa: 43 / (10 × 4) = 1.075 is within the 10 % tolerance: stays 10": ("hpa", 10, 43, 10),
    "hpa: 45 / (10 × 4) = 1.125 is not: ceil(45 / 4) = 12": ("hpa", 10, 45, 12),
    "hpa: down to ceil(8 / 4) = 2": ("hpa", 10, 8, 2),
    "knative: ceil(37 / (0.7 × 4)) = ceil(13.2) = 14": ("knative_kpa", 1, 37, 14),
    "knative: down to 14 from 40": ("knative_kpa", 40, 37, 14),
    "ray: ceil(37 / 4) = 10": ("ray_serve", 1, 37, 10),
    "ray: down to ceil(8 / 4) = 2 after its 600 s delay": ("ray_serve", 10, 8, 2),
    "aibrix: ceil(37 / 4) = 10": ("aibrix_kpa", 1, 37, 10),
    "aibrix: down to ceil(8 / 4) = 2": ("aibrix_kpa", 10, 8, 2),
    "aibrix: a total of 4.2 is within 10 % of one replica's target 4: 3 stay 3": ("aibrix_kpa", 3, 4.2, 3),
}


@pytest.mark.parametrize("name, initial, in_flight, expected", CONSTANT_DEMAND.values(), ids=CONSTANT_DEMAND)
def test_constant_demand_converges_to_the_systems_formula(name, initial, in_flight, expected):
    orders = run(anchor(name, initial), steady(900, in_flight), initial)
    assert orders[-60:] == [expected] * 60


def test_ray_serve_at_its_literal_default_target_of_2_orders_twice_as_many():
    policy = RayServe(RAY_SERVE_DEFAULT_TARGET_ONGOING_REQUESTS, min_replicas=1, max_replicas=100, initial_replicas=1)
    assert run(policy, steady(60, 37), initial=1)[-1] == 19  # ceil(37 / 2)


# --- Kubernetes HPA ---------------------------------------------------------------------------

def test_hpa_grows_at_most_max_plus_4_or_double_per_15_s_sync():
    orders = run(anchor("hpa", 2), steady(80, 400), initial=2)  # wants ceil(400 / 4) = 100
    # 2 → max(2 + 4, 2 × 2) = 6 → max(10, 12) = 12 → 24 → 48 → 96, one step per sync
    assert changes(orders) == [(0, 6), (15, 12), (30, 24), (45, 48), (60, 96)]
    assert run(anchor("hpa", 1), steady(1, 400), initial=1) == [5]  # 1 + 4 beats 2 × 1


def test_hpa_holds_a_scale_down_until_the_last_higher_recommendation_is_300_s_old():
    orders = run(anchor("hpa", 10), steady(60, 40) + steady(400, 8), initial=10)
    # the syncs up to 45 s recommend 10 (40 / 4); from 60 s, 2; 45 s + 300 s = 345 s
    assert changes(orders) == [(0, 10), (345, 2)]


def test_a_new_hpa_waits_300_s_before_its_first_scale_down():
    orders = run(anchor("hpa", 10), steady(400, 8), initial=10)
    assert changes(orders) == [(0, 10), (300, 2)]  # its creation records 10 at 0 s


PODS_METRIC = {
    # name: (in flight, ready, starting, current, expected); target 4, tolerance 0.1
    "all ready: ceil(26 / (2 × 4) × 2) = 7": (26, 2, 0, 2, 7),
    "starting pods count as 0 on a scale-up: 26 / (6 × 4) = 1.08, within 10 %": (26, 2, 4, 6, 6),
    "40 / (6 × 4) = 1.67: ceil(1.67 × 6) = 10": (40, 2, 4, 6, 10),
    "starting pods count at the target on a scale-down: (4 + 2 × 4) / 10 pods / 4 → 3, not 1": (4, 8, 2, 10, 3),
    "a ratio that flips from up (5) to down (40 / 48) holds": (40, 2, 10, 12, 12),
    "no pod ready: no metric": (40, 0, 3, 3, None),
}


@pytest.mark.parametrize("in_flight, ready, starting, current, expected", PODS_METRIC.values(), ids=PODS_METRIC)
def test_hpa_pods_metric_recommendation(in_flight, ready, starting, current, expected):
    assert pods_metric_replicas(in_flight, ready, starting, current, target=4, tolerance=0.1) == expected


def test_hpa_holds_while_no_pod_is_ready():
    hpa = KubernetesHPA(4, min_replicas=1, max_replicas=100, initial_replicas=3)
    assert hpa.decide(view_at(0.0, 500.0, ready=0, starting=3)) == 3


# --- Knative KPA (target 10 here: 7 with the 70 % utilization) ----------------------------------

def test_knative_panics_on_a_3x_spike_and_scales_within_the_panic_window():
    kpa = KnativeKPA(10, min_replicas=1, max_replicas=100, initial_replicas=5)
    spike = steady(120, 35) + steady(7, 105)  # 5 replicas × 7 = 35, then 3 ×
    orders = run(kpa, spike, initial=5)
    assert kpa.panicking
    # 124 s: the 6 s panic window holds 35 + 5 × 105 → ceil(93.3 / 7) = 14 ≥ 2 × 6 ready: panic
    assert changes(orders)[-2:] == [(124, 14), (126, 15)]  # ceil(105 / 7) = 15, 6 s after the spike


def test_knative_never_scales_down_in_panic_and_leaves_it_a_stable_window_later():
    kpa = KnativeKPA(10, min_replicas=1, max_replicas=100, initial_replicas=5)
    orders = run(kpa, steady(120, 35) + steady(20, 105) + steady(100, 35), initial=5)
    assert set(orders[126:186]) == {15}  # back to 35 from 140 s, still 15
    # last over the threshold at 124 s; 124 + 60 < 186: the stable count, (13 × 105 + 47 × 35) / 60 / 7 → 8
    assert orders[186] == 8


def test_knative_scales_down_by_at_most_half_per_2_s_tick():
    orders = run(KnativeKPA(10, min_replicas=1, max_replicas=100, initial_replicas=40), steady(100, 7), initial=40)
    # created with 40 ready it starts in panic and holds them; after 60 s the stable count is 1
    assert changes(orders) == [(0, 40), (62, 20), (64, 10), (66, 5), (68, 2), (70, 1)]


# --- Ray Serve ---------------------------------------------------------------------------------

def test_ray_serve_waits_30_s_before_scaling_up():
    orders = run(anchor("ray_serve", 1), steady(60, 37), initial=1)
    assert changes(orders) == [(0, 1), (30, 10)]


def test_ray_serve_waits_600_s_before_scaling_down():
    orders = run(anchor("ray_serve", 10), steady(100, 40) + steady(700, 8), initial=10)
    # the push at 110 s averages (20 × 40 + 10 × 8) / 30 → 8 < 10: the decision streak starts
    assert changes(orders) == [(0, 10), (710, 2)]


STREAK_BREAKS = {
    # name: (initial, wanting up, the break, expected); 20 s up, 5 s of the break, up again from 25 s
    "no change wanted (4 in flight wants 1 = the order)": (1, 37, 4, [(0, 1), (55, 10)]),
    "a scale-down wanted (8 in flight wants 2 < 10)": (10, 60, 8, [(0, 10), (55, 15)]),
}


@pytest.mark.parametrize("initial, up, pause, expected", STREAK_BREAKS.values(), ids=STREAK_BREAKS)
def test_ray_serve_restarts_its_delay_when_a_decision_breaks_the_streak(initial, up, pause, expected):
    ray = RayServe(4, min_replicas=1, max_replicas=100, initial_replicas=initial, look_back_period_s=1,
                   metrics_interval_s=1)  # the decisions follow the in flight of each second
    orders = run(ray, steady(20, up) + steady(5, pause) + steady(40, up), initial=initial)
    assert changes(orders) == expected


def test_ray_serve_scales_from_zero_at_once_when_requests_arrive():
    ray = RayServe(4, min_replicas=0, max_replicas=10, initial_replicas=0)
    assert ray.decide(view_at(0.0, 0.0, ready=0)) == 0
    ray = RayServe(4, min_replicas=0, max_replicas=10, initial_replicas=0)
    assert ray.decide(view_at(0.0, 5.0, ready=0)) == 1


# --- AIBrix KPA --------------------------------------------------------------------------------

def test_aibrix_reconciles_again_after_each_change_so_one_sync_reaches_the_count():
    orders = run(anchor("aibrix_kpa", 1), steady(60, 37), initial=1)
    assert changes(orders) == [(0, 10)]  # 1 → 2 → 4 → 8 → 10, each status write reconciling again


def test_aibrix_at_most_doubles_per_reconcile():
    aibrix = AIBrixKPA(4, min_replicas=1, max_replicas=100, initial_replicas=1, follow_up_reconciles=False)
    assert changes(run(aibrix, steady(60, 37), initial=1)) == [(0, 2), (10, 4), (20, 8), (30, 10)]


def test_aibrix_cooldown_does_not_delay_a_scale_down():
    orders = run(anchor("aibrix_kpa", 10), steady(100, 40) + steady(60, 8), initial=10)
    # 110 s: the 180 s mean (10 × 40 + 2 × 8) / 12 = 34.7 → 9; HPA would hold 10 until 300 s later
    assert changes(orders)[:2] == [(0, 10), (110, 9)]


COOLDOWN = {
    # name: (history, recommended, current, expected)
    "down: the lowest recommendation of the last 300 s": (((100.0, 3), (200.0, 10)), 9, 10, 3),
    "down: older than 300 s is forgotten": (((-60.0, 3), (200.0, 10)), 9, 10, 9),
    "up: the recommendation itself (0 s window)": (((100.0, 3),), 12, 10, 12),
    "same: the current count": (((100.0, 3),), 10, 10, 10),
}


@pytest.mark.parametrize("history, recommended, current, expected", COOLDOWN.values(), ids=COOLDOWN)
def test_aibrix_cooldown_at_250_s(history, recommended, current, expected):
    ordered, kept = aibrix_cooldown(history, recommended, current, now_s=250.0, up_window_s=0, down_window_s=300)
    assert ordered == expected
    assert kept[-1] == (250.0, recommended)


def test_aibrix_with_a_pod_metric_divides_the_per_pod_mean_by_the_target():
    pod = AIBrixKPA(4, min_replicas=1, max_replicas=100, initial_replicas=2, metric_source="pod")
    orders = run(pod, steady(600, 40), initial=2)
    # 0 s: 40 / 2 pods / 4 = 5 replicas; then 40 / 5 / 4 = 2, 40 / 3 / 4 = 3.3, …: never the 10 needed
    assert orders[0] == 5 and set(orders[60:]) == {3, 4}


# --- every anchor ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ANCHORS)
def test_orders_never_exceed_max_replicas(name):
    orders = run(anchor(name, 2, max_replicas=5), steady(200, 10_000), initial=2)
    assert max(orders) <= 5 and orders[-1] == 5


@pytest.mark.parametrize("name", ANCHORS)
def test_orders_never_go_below_min_replicas(name):
    orders = run(anchor(name, 8, min_replicas=3), steady(900, 0), initial=8)
    assert min(orders) >= 3 and orders[-1] == 3


@pytest.mark.parametrize("name", ANCHORS)
def test_no_replica_ready_yields_an_order_within_bounds(name):
    policy = anchor(name, 2, min_replicas=1, max_replicas=10)
    orders = [policy.decide(view_at(float(t), 30.0, ready=0, starting=2)) for t in range(30)]
    assert all(1 <= order <= 10 for order in orders)


@pytest.mark.parametrize("name", ANCHORS)
@settings(max_examples=40)
@given(in_flight=st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), min_size=1, max_size=120),
       min_replicas=st.integers(0, 3), extra=st.integers(0, 20))
def test_orders_always_lie_within_bounds(name, in_flight, min_replicas, extra):
    max_replicas = max(min_replicas, 1) + extra
    orders = run(anchor(name, min_replicas, min_replicas, max_replicas), in_flight, initial=min_replicas)
    assert all(min_replicas <= order <= max_replicas for order in orders)


@pytest.mark.parametrize("bounds", [dict(min_replicas=3, max_replicas=2, initial_replicas=2),
                                    dict(min_replicas=1, max_replicas=5, initial_replicas=6),
                                    dict(min_replicas=0, max_replicas=0, initial_replicas=0)])
@pytest.mark.parametrize("name", ANCHORS)
def test_inconsistent_bounds_are_refused(name, bounds):
    with pytest.raises(ValueError):
        ANCHORS[name](**bounds)
