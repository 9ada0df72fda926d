"""Reading named samples out of a Prometheus page: the same samples the full parser gives, whatever
else the page holds (serving.runtime.scrape; the supervisor reads each replica's page every second)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serving.runtime.scrape import samples_named

NAMES = ("vllm:num_requests_running", "vllm:num_requests_running_max", "vllm:request_success", "vllm:e2e_latency",
         "vllm:num_requests")
LABEL_VALUES = st.text(alphabet=st.sampled_from(list('ab {}"\\\n,=# ')), max_size=8)


def full_parse(text: str, names) -> list:
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name in set(names)]


@st.composite
def pages(draw) -> str:
    """A page as prometheus_client writes it: counters, gauges and histograms, labelled or not,
    whose names are prefixes of one another, with label values holding spaces, braces, quotes
    and newlines."""
    registry = CollectorRegistry()
    for name in draw(st.lists(st.sampled_from(NAMES), unique=True, min_size=1)):
        kind = draw(st.sampled_from([Counter, Gauge, Histogram]))
        labelled = draw(st.booleans())
        metric = kind(name, "help text {with} \"quotes\"", ["reason"] if labelled else [], registry=registry)
        for value in draw(st.lists(LABEL_VALUES, min_size=1, max_size=3)):
            child = metric.labels(value) if labelled else metric
            amount = draw(st.floats(min_value=0, max_value=1e6, allow_nan=False))
            getattr(child, {Counter: "inc", Gauge: "set", Histogram: "observe"}[kind])(amount)
    return generate_latest(registry).decode()


@settings(max_examples=60, deadline=None)
@given(page=pages(), wanted=st.lists(st.sampled_from(
    [n + suffix for n in NAMES for suffix in ("", "_total", "_bucket", "_count", "_created")]), min_size=1))
def test_the_named_samples_are_those_the_full_parser_reads(page, wanted):
    assert [(s.name, s.labels, s.value) for s in samples_named(page, wanted)] == full_parse(page, wanted)


def test_a_name_that_begins_another_takes_only_its_own_samples():
    page = "vllm:num_requests_running 2\nvllm:num_requests_running_max 9\nvllm:num_requests_runningx 7\n"
    assert [s.value for s in samples_named(page, ["vllm:num_requests_running"])] == [2.0]
