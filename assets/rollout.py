"""Rolling a new revision out: a generator of actions, driven by ``served_endpoint``.

The generator decides; the driver acts and sends back each action's result, so a test can
step through a rollout with no I/O (as httpx's ``Auth.auth_flow`` is tested):

    flow = rollout("gec", "gec-v2-1a2b", replicas=1, expected_previous="gec-v1-9f8e")
    flow.send(None)          → Start("gec-v2-1a2b", 1)
    flow.send(None)          → WaitReady("gec-v2-1a2b", 1)
    flow.send(True)          → StillCurrent("gec")
    flow.send(True)          → Route("gec", "gec-v2-1a2b", "gec-v1-9f8e")
    flow.send("gec-v1-9f8e") → Drain("gec-v1-9f8e")
    flow.send(None)          → Retire("gec-v1-9f8e")
    flow.send(None)          → StopIteration(RolloutResult(ok=True, …))

Traffic moves only after the new revision is ready, and the old revision is retired only
after it drained, so requests in flight during the switch finish where they started. The
switch is a compare-and-set against the revision that served when the rollout began: if
another rollout moved the endpoint meanwhile, the driver answers :class:`Superseded` and
this rollout retires its own revision (the registry sensor then converges the endpoint to
what its alias names).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass


@dataclass(frozen=True)
class Start:
    revision_id: str
    replicas: int


@dataclass(frozen=True)
class WaitReady:
    """Result: True when every replica is ready, False on timeout or crash loop."""

    revision_id: str
    replicas: int


@dataclass(frozen=True)
class StillCurrent:
    """Result: True when the endpoint's alias still points at the version being rolled out.

    Asked right before traffic moves: a slow rollout of v3 must not take the endpoint back
    from v4 when the alias moved on while v3 was loading."""

    endpoint: str


@dataclass(frozen=True)
class Route:
    """Result: the revision id that served the endpoint before (or None), or :class:`Superseded`
    when the endpoint no longer routes to ``expected_previous``."""

    endpoint: str
    revision_id: str
    expected_previous: str | None = None


@dataclass(frozen=True)
class CanaryPlan:
    """The spec's ``rollout`` section, for a rollout that replaces a serving revision."""

    percent: float
    duration_s: float
    slo_p99_ms: float
    max_error_increase: float
    max_p99_ratio: float


@dataclass(frozen=True)
class Canary:
    """Result: a :class:`CanaryVerdict`. The new revision takes ``plan.percent`` of the requests
    for ``plan.duration_s`` beside ``serving_revision_id`` (``assets.canary``)."""

    endpoint: str
    revision_id: str
    serving_revision_id: str
    plan: CanaryPlan


@dataclass(frozen=True)
class CanaryVerdict:
    ok: bool
    reason: str


@dataclass(frozen=True)
class Superseded:
    """Another rollout moved the endpoint to ``current`` since this one began."""

    current: str | None


@dataclass(frozen=True)
class Drain:
    revision_id: str


@dataclass(frozen=True)
class Retire:
    revision_id: str


@dataclass(frozen=True)
class RolloutResult:
    ok: bool
    revision_id: str
    previous_revision_id: str | None = None
    reason: str = ""
    superseded: bool = False


Action = Start | WaitReady | StillCurrent | Canary | Route | Drain | Retire


def rollout(endpoint: str, revision_id: str, replicas: int, expected_previous: str | None = None,
            canary: CanaryPlan | None = None) -> Generator[Action, object, RolloutResult]:
    """With ``canary`` and a revision serving already, the new one first takes a share of the
    traffic (:class:`Canary`); a failed canary retires it and the endpoint stays where it was."""
    yield Start(revision_id, replicas)
    ready = yield WaitReady(revision_id, replicas)
    if not ready:
        yield Retire(revision_id)
        return RolloutResult(ok=False, revision_id=revision_id, reason="the new revision never became ready; "
                                                                       "the endpoint keeps its current revision")
    if canary is not None and expected_previous is not None:
        if not (yield StillCurrent(endpoint)):
            yield Retire(revision_id)
            return RolloutResult(ok=False, revision_id=revision_id, superseded=True,
                                 reason="the alias moved to another version during the rollout; traffic stays where "
                                        "it is")
        verdict = yield Canary(endpoint, revision_id, expected_previous, canary)
        if not verdict.ok:
            yield Drain(revision_id)  # what the canary took finishes where it started
            yield Retire(revision_id)
            return RolloutResult(ok=False, revision_id=revision_id, reason=f"the canary failed: {verdict.reason}; "
                                                                           "the endpoint keeps its current revision")
    if not (yield StillCurrent(endpoint)):
        yield Retire(revision_id)
        return RolloutResult(ok=False, revision_id=revision_id, superseded=True,
                             reason="the alias moved to another version during the rollout; traffic stays where it is")
    previous = yield Route(endpoint, revision_id, expected_previous)
    if isinstance(previous, Superseded):
        yield Retire(revision_id)
        return RolloutResult(ok=False, revision_id=revision_id, superseded=True,
                             reason=f"another rollout moved the endpoint to {previous.current} meanwhile; "
                                    "traffic stays there")
    if previous is not None and previous != revision_id:
        yield Drain(previous)
        yield Retire(previous)
    return RolloutResult(ok=True, revision_id=revision_id, previous_revision_id=previous)
