"""Which replica ids start and stop: named victims first, then the highest indices; gaps refilled lowest first."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.replica_plan import plan


@pytest.mark.parametrize("desired, running, retiring, to_start, to_stop", [
    pytest.param({"r": 2}, set(), {}, ["r-0", "r-1"], [], id="a new revision starts from index 0"),
    pytest.param({"r": 1}, {"r-0", "r-1"}, {}, [], ["r-1"], id="no victims: the highest index stops"),
    pytest.param({"r": 1}, {"r-0", "r-1"}, {"r": ["r-0"]}, [], ["r-0"], id="a named victim stops instead"),
    pytest.param({"r": 2}, {"r-0", "r-1", "r-2"}, {"r": ["r-0", "r-1"]}, [], ["r-0"],
                 id="victims stop in the order named, only as many as the count drops"),
    pytest.param({"r": 1}, {"r-0", "r-1", "r-2"}, {"r": ["r-0"]}, [], ["r-0", "r-2"],
                 id="fewer victims than the drop: then the highest index left"),
    pytest.param({"r": 1}, {"r-0", "r-1"}, {"r": ["r-7", "q-0"]}, [], ["r-1"], id="unknown ids are ignored"),
    pytest.param({"r": 2}, {"r-0", "r-1"}, {"r": ["r-0"]}, [], [], id="at the count, a victim keeps running"),
    pytest.param({"r": 3}, {"r-1"}, {"r": ["r-1"]}, ["r-0", "r-2"], [], id="below it: lowest free indices start"),
    pytest.param({"r": 3}, {"r-0", "r-2"}, {}, ["r-1"], [], id="a gap a victim left is filled first"),
    pytest.param({"r": 0}, {"r-1", "r-4"}, {"r": ["r-4"]}, [], ["r-1", "r-4"], id="scaled to zero: all stop"),
    pytest.param({"a-b": 1}, {"a-b-0", "gone-0"}, {}, [], ["gone-0"], id="a revision no longer wanted stops"),
    pytest.param({"a": 1, "a-1": 1}, {"a-1", "a-1-0"}, {"a": ["a-1"]}, [], [],
                 id="revision ids may hold dashes: a-1 is replica 1 of a"),
])
def test_plan_stops_named_victims_first_and_refills_the_lowest_free_indices(desired, running, retiring, to_start,
                                                                           to_stop):
    assert plan(desired, running, retiring) == (to_start, to_stop)


@given(count=st.integers(0, 6), indices=st.sets(st.integers(0, 9), max_size=8),
       retiring=st.lists(st.integers(0, 11), max_size=5, unique=True))
def test_after_a_plan_the_revision_runs_exactly_its_count_under_unique_ids(count, indices, retiring):
    running = {f"r-{i}" for i in indices}
    named = [f"r-{i}" for i in retiring]
    to_start, to_stop = plan({"r": count}, running, {"r": named})
    after = (running - set(to_stop)) | set(to_start)
    assert len(after) == count and not set(to_start) & running and set(to_stop) <= running
    assert not (to_start and to_stop)  # a revision only grows or only shrinks in one pass
    running_victims = [v for v in named if v in running]
    must_go = max(0, len(running) - count)
    assert set(running_victims[:must_go]) <= set(to_stop)  # the named go before any other
    if len(running) <= count:
        assert to_stop == []  # victims are ignored unless the count goes down
