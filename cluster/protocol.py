"""The ``Cluster`` Protocol: what deploy steps and the router need from where replicas run.

The local backend (``cluster.local``) runs replicas as processes on this machine; a
Kubernetes backend maps the same calls onto Deployments, the scale subresource and
EndpointSlices. ``cluster.fake.InMemoryCluster`` has the same semantics, for unit tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RevisionSpec:
    """One revision of an endpoint: which model files, which runtime, how many replicas."""

    revision_id: str
    endpoint: str
    model_dir: str
    runtime: str  # "vllm" | "pyfunc"
    replicas: int
    runtime_config: dict = field(default_factory=dict)
    # The serving image to start replicas from (images.source_ref.ImageRef.to_json()); None: the
    # model directory and this machine's runtime environment, read in place.
    image: dict | None = None
    # The measured time to ready of this model's replicas (the cost sweep's, or an earlier start's),
    # if known: Kubernetes sizes the startupProbe from it; the local supervisor waits on readiness itself.
    expected_start_s: float | None = None


@dataclass(frozen=True)
class Replica:
    replica_id: str
    revision_id: str
    url: str  # base URL, e.g. http://127.0.0.1:41234
    ready: bool  # model loaded and a warm-up request answered
    state: str  # starting | ready | unhealthy | stopped (Kubernetes also: terminating, draining before it stops)
    restarts: int = 0
    # Why its last life ended or failed to start, as the backend knows it (the local one: the
    # exit code and the end of the process's output); None when nothing went wrong or the
    # backend cannot tell (Kubernetes: its EndpointSlices carry no reasons).
    last_error: str | None = None


class Cluster(Protocol):
    def apply(self, spec: RevisionSpec) -> None:
        """Create the revision, or update it to ``spec`` (idempotent)."""

    def scale(self, revision_id: str, replicas: int, victims: Sequence[str] = ()) -> None:
        """Set the desired replica count; KeyError for an unknown revision, ValueError below 0.

        ``victims``: replica ids to stop first when the count goes down, in that order and only
        as many as the count drops; the rest of the drop stops the highest replica indices.
        Ignored when the count does not go down; unknown ids are ignored. A later scale-up
        starts the lowest free indices, so replica ids stay unique.
        """

    def replicas(self, revision_id: str | None = None) -> list[Replica]:
        """Current replicas, of one revision or of all."""

    def desired_replicas(self, revision_id: str) -> int:
        """The count the revision is scaled to now (whoever scaled it last); KeyError for an unknown one."""

    def watch(self, interval_s: float = 0.5, stop: Callable[[], bool] = lambda: False) -> Iterator[list[Replica]]:
        """Yield the full replica list now and then each time it changes, until ``stop()``."""

    def delete(self, revision_id: str) -> None:
        """Stop every replica of the revision and forget it (idempotent)."""

    def converge(self, active: Sequence[RevisionSpec]) -> list[str]:
        """Finish the ``active`` revisions that a crash left half-created and remove whatever the
        backend runs for any other revision; what it changed, in words (empty: nothing to do).
        A revision that exists keeps its replica count (an autoscaler may have changed it)."""


def poll_changes(read: Callable[[], list[Replica]], interval_s: float,
                 stop: Callable[[], bool] = lambda: False) -> Iterator[list[Replica]]:
    """``watch`` for backends without change notifications: read every ``interval_s``, yield
    the list now and whenever it differs from the last one yielded, until ``stop()``."""
    last = None
    while not stop():
        current = read()
        if current != last:
            last = current
            yield current
        time.sleep(interval_s)
