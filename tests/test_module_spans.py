"""The end-of-run summary of modules' spans (tests/module_spans.py)."""

from tests.module_spans import spans, summary


def test_a_modules_span_runs_from_its_first_start_to_its_last_stop_set_ups_included():
    reports = [("tests/test_a.py::one", "gw0", 10.0, 30.0), ("tests/test_a.py::two", "gw0", 30.0, 95.0),
               ("tests/test_b.py::one", "gw1", 12.0, 20.0), ("tests/test_a.py::one", "gw0", 8.0, 10.0)]
    found = spans(reports)
    assert [(s.module, s.worker, s.seconds) for s in found] == [("tests/test_a.py", "gw0", 87.0),
                                                                ("tests/test_b.py", "gw1", 8.0)]


def test_the_summary_names_the_longest_modules_first_from_the_runs_first_test():
    reports = [("tests/test_b.py::x", "gw1", 100.0, 104.0), ("tests/test_a.py::y", "gw0", 101.0, 200.0)]
    lines = summary(reports, top=1)
    assert lines[0] == "the 1 longest modules of 2 (span, worker, from -> to in s):"
    assert lines[1].split() == ["99.0s", "gw0", "1.0", "->", "100.0", "tests/test_a.py"]


def test_no_reports_print_nothing():
    assert summary([]) == []
