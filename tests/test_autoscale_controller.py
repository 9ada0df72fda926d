"""The controller gathers, calls the policies and applies: tested with fakes and a fake clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autoscale.clock import FakeClock
from autoscale.controller.loop import (Controller, ControllerConfig, EndpointLoad, EndpointPlan, ReplicaCounts,
                                       ReplicaStats)

PLAN = EndpointPlan(endpoint="gec", revision_id="gec-v1-aa", runtime="pyfunc", desired_replicas=1, min_replicas=1,
                    max_replicas=8, target_concurrency=4.0, target_pinned=False, sweep_concurrency=(1, 2, 4, 8, 16),
                    slo_p99_ms=1000.0, scale_to_zero_grace_s=300.0, unit_cost_ms=None)


class Recorder:
    """ScalingStore's semantics, in memory."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.minutes: dict[tuple[str, int], float] = {}

    def record(self, endpoint, revision_id, axis, **fields):
        self.rows.append({"endpoint": endpoint, "revision_id": revision_id, "axis": axis, **fields})

    def save_demand(self, endpoint, minute, peak_in_flight):
        self.minutes[endpoint, minute] = max(peak_in_flight, self.minutes.get((endpoint, minute), 0.0))

    def demand(self, endpoint, since_minute):
        return {m: p for (e, m), p in sorted(self.minutes.items()) if e == endpoint and m >= since_minute}


class Fleet:
    """What the fakes share: the plan the stores hold, the replicas, and the load the routers see."""

    def __init__(self, plan: EndpointPlan = PLAN) -> None:
        self.plan = plan
        self.ready = plan.desired_replicas
        self.starting = 0
        self.load = EndpointLoad()
        self.stats = ReplicaStats()
        self.leader = True
        self.scaled: list[tuple[str, int]] = []
        self.victims: list[list[str]] = []  # named by each scale call

    def scale(self, revision_id: str, replicas: int, victims=()) -> None:
        self.scaled.append((revision_id, replicas))
        self.victims.append(list(victims))
        self.starting = max(0, replicas - self.ready)
        self.ready = min(self.ready, replicas)
        self.plan = replace(self.plan, desired_replicas=replicas)

    def finish_loading(self) -> None:
        self.ready, self.starting = self.ready + self.starting, 0

    def counts(self) -> ReplicaCounts:
        """Replica ``i`` answers at ``http://r{i}``: the ready ones first, then the starting ones."""
        urls = [f"http://r{i}" for i in range(self.ready + self.starting)]
        return ReplicaCounts(self.ready, self.starting, tuple(urls[:self.ready]),
                             {url: f"{self.plan.revision_id}-{i}" for i, url in enumerate(urls)})


def controller_for(fleet: Fleet, clock: FakeClock, recorder: Recorder) -> Controller:
    class Load:
        def read(self):
            return {fleet.plan.endpoint: fleet.load}

    class Stats:
        def read(self, urls, runtime):
            return fleet.stats

    return Controller(plans=lambda: [fleet.plan],
                      replicas=lambda rid: fleet.counts(),
                      load=Load(), stats=Stats(), scale=fleet.scale, recorder=recorder,
                      is_leader=lambda: fleet.leader, clock=clock, config=ControllerConfig(), log=lambda _m: None)


def run(controller: Controller, clock: FakeClock, seconds: int) -> None:
    for _ in range(seconds):
        controller.tick()
        clock.advance(1.0)


def test_a_load_step_adds_replicas_within_one_decision_and_records_why():
    fleet, clock, recorder = Fleet(), FakeClock(1000.0), Recorder()
    controller = controller_for(fleet, clock, recorder)
    run(controller, clock, 3)
    assert fleet.scaled == []
    fleet.load = EndpointLoad(in_flight_requests=30.0)
    run(controller, clock, 6)  # a scale-up is decided at most every 5 s
    assert fleet.scaled == [("gec-v1-aa", 5)]  # ceil(30 / 4) = 8, one cycle grows 1 by at most +4
    run(controller, clock, 5)
    assert fleet.scaled == [("gec-v1-aa", 5), ("gec-v1-aa", 8)]
    first, second = recorder.rows
    assert first["axis"] == "horizontal" and first["replicas"] == 5 and "30" in first["reason"]
    assert second["replicas"] == 8 and second["inputs"]["signal"] == "requests"


def test_no_more_replicas_are_ordered_while_the_last_order_is_loading():
    fleet, clock, recorder = Fleet(replace(PLAN, max_replicas=20)), FakeClock(1000.0), Recorder()
    controller = controller_for(fleet, clock, recorder)
    fleet.load = EndpointLoad(in_flight_requests=12.0)
    run(controller, clock, 6)
    assert fleet.scaled == [("gec-v1-aa", 3)]
    run(controller, clock, 30)  # still loading: 1 ready + 2 starting cover 12 in flight
    assert fleet.scaled == [("gec-v1-aa", 3)]


def test_a_controller_that_just_started_does_not_scale_down_for_lack_of_history():
    fleet, clock, recorder = Fleet(replace(PLAN, desired_replicas=6)), FakeClock(1000.0), Recorder()
    controller = controller_for(fleet, clock, recorder)
    run(controller, clock, 290)  # idle, but the controller has not seen five minutes yet
    assert fleet.scaled == []
    run(controller, clock, 20)
    assert fleet.scaled == [("gec-v1-aa", 1)]


def test_a_controller_that_loses_the_lease_forgets_its_history_and_acts_no_more():
    fleet, clock, recorder = Fleet(replace(PLAN, desired_replicas=6)), FakeClock(1000.0), Recorder()
    controller = controller_for(fleet, clock, recorder)
    run(controller, clock, 200)
    fleet.leader = False
    run(controller, clock, 200)
    assert fleet.scaled == [] and controller.windows == {}
    fleet.leader = True
    run(controller, clock, 200)  # leading again, with 200 s of history: still no scale-down
    assert fleet.scaled == []


def test_model_unit_mode_scales_on_units_against_the_target_in_units():
    # α 1 ms/token, β 10 ms/token, γ 40 ms at c = 4; the reference request (64 in, 16 out) costs
    # (64 + 160 + 40) / 4 = 66 units, so a replica's target of 4 concurrent requests is 264 units
    plan = replace(PLAN, runtime="vllm", unit_cost_ms=(1.0, 10.0, 40.0, 4))
    fleet, clock, recorder = Fleet(plan), FakeClock(1000.0), Recorder()
    controller = controller_for(fleet, clock, recorder)
    fleet.load = EndpointLoad(in_flight_requests=2.0, in_flight_units=1000.0)  # 2 long requests
    run(controller, clock, 6)
    assert fleet.scaled == [("gec-v1-aa", 4)]  # ceil(1000 / 264), where counting requests would keep 1
    assert recorder.rows[0]["inputs"]["signal"] == "model_units"


def test_the_vertical_axis_cuts_a_target_when_p99_breaks_the_slo_and_records_it():
    fleet, clock, recorder = Fleet(), FakeClock(1000.0), Recorder()
    controller = controller_for(fleet, clock, recorder)
    fleet.load = EndpointLoad(in_flight_requests=4.0, p99_latency_ms=2000.0, requests=500)
    run(controller, clock, 2)
    [vertical] = [r for r in recorder.rows if r["axis"] == "vertical"]
    assert vertical["target"] < 4.0 and vertical["target"] >= 2.0  # cut fast, but by at most half
    assert controller.windows["gec"].vertical.target == vertical["target"]


def test_a_pinned_target_is_left_alone():
    fleet, clock, recorder = Fleet(replace(PLAN, target_pinned=True)), FakeClock(1000.0), Recorder()
    controller = controller_for(fleet, clock, recorder)
    fleet.load = EndpointLoad(in_flight_requests=4.0, p99_latency_ms=5000.0, requests=500)
    run(controller, clock, 120)
    assert [r for r in recorder.rows if r["axis"] == "vertical"] == []


def test_a_restarted_controller_resumes_from_the_recorded_target():
    fleet, clock, recorder = Fleet(replace(PLAN, recorded_target=6.0)), FakeClock(1000.0), Recorder()
    controller = controller_for(fleet, clock, recorder)
    run(controller, clock, 1)
    assert controller.windows["gec"].vertical.target == 6.0


def test_a_new_revision_starts_a_new_window():
    fleet, clock, recorder = Fleet(), FakeClock(1000.0), Recorder()
    controller = controller_for(fleet, clock, recorder)
    run(controller, clock, 10)
    fleet.plan = replace(fleet.plan, revision_id="gec-v2-bb")
    run(controller, clock, 1)
    assert controller.windows["gec"].revision_id == "gec-v2-bb" and len(controller.windows["gec"].samples) == 1


def test_each_minute_s_peak_is_stored_and_a_new_controller_reloads_it():
    fleet, clock, recorder = Fleet(), FakeClock(60_000.0), Recorder()
    controller = controller_for(fleet, clock, recorder)
    fleet.load = EndpointLoad(in_flight_requests=3.0)
    run(controller, clock, 30)
    fleet.load = EndpointLoad(in_flight_requests=2.0)
    run(controller, clock, 40)  # into the next minute: the first one is stored
    assert recorder.minutes == {("gec", 1000): 3.0}
    restarted = controller_for(fleet, clock, recorder)
    run(restarted, clock, 1)
    assert restarted.windows["gec"].history.peak_by_minute[1000] == 3.0


def test_the_predictive_floor_adds_replicas_before_yesterday_s_ramp_comes_back():
    day_s = 86_400
    recorder = Recorder()
    for minute in range(int((10 * 3600) // 60), int((10 * 3600 + 600) // 60)):  # yesterday 10:00-10:10: 40 in flight
        recorder.save_demand("gec", minute, 40.0)
    for minute in range(int((9 * 3600) // 60), int((10 * 3600) // 60)):  # yesterday before it: 2 in flight
        recorder.save_demand("gec", minute, 2.0)
    fleet = Fleet(replace(PLAN, max_replicas=20, cold_start_s=120.0))
    clock = FakeClock(day_s + 10 * 3600 - 300)  # today 09:55, with the same quiet load as yesterday at 09:55
    controller = controller_for(fleet, clock, recorder)
    fleet.load = EndpointLoad(in_flight_requests=2.0)
    run(controller, clock, 200)  # past 09:58: the 10:00 ramp is within the 120 s cold start
    assert fleet.scaled and fleet.scaled[-1][1] == 10  # ceil(40 / 4), ordered before the load arrives
    assert any(r["rule"] == "predictive-floor" for r in recorder.rows)


def test_a_floor_that_falls_is_held_for_the_scale_down_lookback_not_left_the_next_minute():
    """Yesterday's 10:00 minute peaked at 40 in flight, the minutes around it at 2. Today the floor
    orders 10 replicas ahead of 10:00; once that minute has passed the forecast falls, but the
    order stays until the 300 s lookback no longer holds it, as a peak's would."""
    day_s = 86_400
    recorder = Recorder()
    for minute in range(int((9 * 3600) // 60), int((11 * 3600) // 60)):
        recorder.save_demand("gec", minute, 40.0 if minute == 600 else 2.0)  # minute 600 is 10:00
    fleet = Fleet(replace(PLAN, max_replicas=20, cold_start_s=60.0))
    clock = FakeClock(day_s + 10 * 3600 - 480)  # today 09:52: a full lookback of history before the floor
    controller = controller_for(fleet, clock, recorder)
    fleet.load = EndpointLoad(in_flight_requests=2.0)
    run(controller, clock, 510)  # 10:00:30: the 10:00 minute came within the 60 s horizon: ceil(40 / 4) = 10
    assert fleet.scaled[-1][1] == 10
    run(controller, clock, 140)  # 10:02:50: the forecast fell to ceil(2 / 4) = 1 at 10:01
    assert fleet.scaled[-1][1] == 10
    run(controller, clock, 220)  # 10:06:30: the 10 is older than the 300 s lookback
    assert fleet.scaled[-1][1] == 1


def test_a_scale_up_names_no_victims():
    fleet, clock, recorder = Fleet(), FakeClock(1000.0), Recorder()
    controller = controller_for(fleet, clock, recorder)
    fleet.load = EndpointLoad(in_flight_requests=12.0)
    run(controller, clock, 6)
    assert fleet.scaled == [("gec-v1-aa", 3)] and fleet.victims == [[]]
    assert "victims" not in recorder.rows[0]["inputs"]


# Three replicas, a quiet lookback that wants two. Counting requests, r0 holds the least (one long
# generation); counting model units, r1 does (two short requests). The backend alone would stop r2.
BY_URL_REQUESTS = {"http://r0": 1.0, "http://r1": 2.0, "http://r2": 3.0}
BY_URL_UNITS = {"http://r0": 300.0, "http://r1": 60.0, "http://r2": 100.0}


@pytest.mark.parametrize("unit_cost_ms, victim", [
    pytest.param(None, "gec-v1-aa-0", id="requests: the fewest requests in flight"),
    pytest.param((1.0, 10.0, 40.0, 4), "gec-v1-aa-1", id="model units: the least work in flight"),
])
def test_a_scale_down_names_the_least_loaded_replica_as_its_victim(unit_cost_ms, victim):
    # ceil(6 requests / 4) = 2; in units, ceil(460 / 264) = 2 (264 units: the model-unit test above)
    plan = replace(PLAN, desired_replicas=3, unit_cost_ms=unit_cost_ms,
                   runtime="vllm" if unit_cost_ms else "pyfunc")
    fleet, clock, recorder = Fleet(plan), FakeClock(1000.0), Recorder()
    controller = controller_for(fleet, clock, recorder)
    fleet.load = EndpointLoad(in_flight_requests=6.0, in_flight_units=460.0,
                              in_flight_requests_by_url=BY_URL_REQUESTS, in_flight_units_by_url=BY_URL_UNITS)
    run(controller, clock, 310)  # past the 300 s lookback
    assert fleet.scaled == [("gec-v1-aa", 2)]
    assert fleet.victims == [[victim]]
    assert recorder.rows[-1]["inputs"]["victims"] == [victim]


def test_a_replica_no_router_sends_to_is_a_victim_before_a_busy_one():
    plan = replace(PLAN, desired_replicas=3, min_replicas=1)
    fleet, clock, recorder = Fleet(plan), FakeClock(1000.0), Recorder()
    controller = controller_for(fleet, clock, recorder)
    fleet.load = EndpointLoad(in_flight_requests=3.0, in_flight_requests_by_url={"http://r0": 2.0, "http://r2": 1.0})
    run(controller, clock, 310)  # ceil(3 / 4) = 1: two go, r1 (absent from the routers: 0) first, then r2
    assert fleet.scaled == [("gec-v1-aa", 1)] and fleet.victims == [["gec-v1-aa-1", "gec-v1-aa-2"]]


def test_the_vertical_interval_of_the_controller_config_is_the_one_used():
    fleet, clock, recorder = Fleet(), FakeClock(1000.0), Recorder()
    controller = controller_for(fleet, clock, recorder)
    controller.config = ControllerConfig(vertical_interval_s=10.0)
    fleet.load = EndpointLoad(in_flight_requests=1.0, p99_latency_ms=5000.0, requests=500)
    run(controller, clock, 25)  # cuts at 0 and 10 s, to the sweep's bound of 1; the 30 s default allows one
    assert [r["target"] for r in recorder.rows if r["axis"] == "vertical"] == [2.0, 1.0]
