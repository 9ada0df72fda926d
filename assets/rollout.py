"""Rolling a new revision out: a generator of actions, driven by ``served_endpoint``.

The generator decides; the driver acts and sends back each action's result, so a test can
step through a rollout with no I/O (as httpx's ``Auth.auth_flow`` is tested):

    flow = rollout("gec", "gec-gec-v2-1", replicas=1)
    flow.send(None)          → Start("gec-gec-v2-1", 1)
    flow.send(None)          → WaitReady("gec-gec-v2-1", 1)
    flow.send(True)          → StillCurrent("gec")
    flow.send(True)          → Route("gec", "gec-gec-v2-1")
    flow.send("gec-gec-v1-1")→ Drain("gec-gec-v1-1")
    flow.send(None)          → Retire("gec-gec-v1-1")
    flow.send(None)          → StopIteration(RolloutResult(ok=True, …))

Traffic moves only after the new revision is ready, and the old revision is retired only
after it drained, so requests in flight during the switch finish where they started.
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
    """Result: the revision id that served the endpoint before, or None."""

    endpoint: str
    revision_id: str


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


Action = Start | WaitReady | StillCurrent | Route | Drain | Retire


def rollout(endpoint: str, revision_id: str, replicas: int) -> Generator[Action, object, RolloutResult]:
    yield Start(revision_id, replicas)
    ready = yield WaitReady(revision_id, replicas)
    if not ready:
        yield Retire(revision_id)
        return RolloutResult(ok=False, revision_id=revision_id, reason="the new revision never became ready; "
                                                                       "the endpoint keeps its current revision")
    if not (yield StillCurrent(endpoint)):
        yield Retire(revision_id)
        return RolloutResult(ok=False, revision_id=revision_id, superseded=True,
                             reason="the alias moved to another version during the rollout; traffic stays where it is")
    previous = yield Route(endpoint, revision_id)
    if previous is not None and previous != revision_id:
        yield Drain(previous)
        yield Retire(previous)
    return RolloutResult(ok=True, revision_id=revision_id, previous_revision_id=previous)
