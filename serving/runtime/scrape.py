"""A few named samples out of a Prometheus text page, cheaply enough to read it every second.

The supervisor reads each replica's progress from its ``/metrics`` once a second
(:mod:`serving.runtime.liveness`), and so do the Kubernetes probes. vLLM's page holds
every histogram bucket of every metric it keeps; ``prometheus_client``'s parser is pure Python
and parses every line of it. Only the lines that are samples of the wanted names reach the
parser here: the same samples, parsed the same way, for the cost of one regular-expression scan.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@functools.cache
def _sample_lines(names: frozenset[str]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True))
    return re.compile(rf"^(?:{alternatives})(?=[{{ \t]).*$", re.MULTILINE)


def samples_named(text: str, names: Iterable[str]) -> Iterator[Sample]:
    """The samples of ``text`` whose name is one of ``names`` (the sample's own name:
    ``x_total``, ``x_bucket``), as ``text_string_to_metric_families`` reads them.

    >>> page = 'ok_total{reason="stop"} 3.0\\nok_total{reason="abort"} 1.0\\nok_totally 9\\nq 2\\n'
    >>> [(s.name, s.labels, s.value) for s in samples_named(page, ["ok_total"])]
    [('ok_total', {'reason': 'stop'}, 3.0), ('ok_total', {'reason': 'abort'}, 1.0)]
    """
    wanted = frozenset(names)
    lines = "\n".join(match.group(0) for match in _sample_lines(wanted).finditer(text))
    for family in text_string_to_metric_families(lines + "\n"):
        for sample in family.samples:
            if sample.name in wanted:
                yield sample
