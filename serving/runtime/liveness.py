"""Liveness by forward progress: a replica is alive while its engine makes progress.

A saturated replica answers ``/health`` late or not at all, and killing it for that throws
away its whole batch and moves its load onto replicas that are just as busy. So modelplane
asks a different question: do its progress counters still move? Those are the completed
requests (``Progress.completed_total`` from ``/metrics``) and, where the engine has one, a
counter of work done (``Progress.work_total``: vLLM's prompt and generated tokens). The
second matters: one generation of 2,000 tokens on a CPU replica completes nothing for
minutes, and a replica judged on completions alone was killed as hung, losing every request
on it; any token holder could make an endpoint crash-loop that way. A stopped engine
(SIGSTOP, a deadlock) moves neither counter and is still found within ``hang_after_s``.

- either moved since the last look → ALIVE, however deep the queue;
- nothing queued or in flight and nothing completed for ``idle_probe_after_s`` → PROBE:
  the supervisor sends the runtime's ``probe_request`` (one token, highest priority), whose
  completion moves the counter like any other request;
- work queued or in flight and no completion for ``hang_after_s`` (counted from the later of
  the last completion and the moment the work was first seen) → HUNG;
- a probe outstanding for ``probe_timeout_s`` with no completion since → HUNG.

Worked example with the defaults (30 s, 60 s, 30 s). A replica completes a request at
t = 100 s and then gets no traffic: at t = 130 s the verdict is PROBE; the probe completes at
t = 130.2 s, the counter moves, ALIVE, and the next probe is due at t = 160.2 s. Had the
engine been stuck, the probe would still be outstanding at t = 160 s: HUNG, 60 s after the
last completion, the same bound a busy replica gets. A saturated replica with 200 requests
queued that completes one every 5 s is ALIVE at every look.

``decide`` is pure: state in, state out, the time passed in (``now_s``, seconds on any
monotonic clock). The supervisor calls it after each ``/metrics`` scrape and acts on the
verdict; a scrape that fails is the supervisor's to judge, not a completion.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from serving.runtime.base import Progress


class Verdict(enum.Enum):
    ALIVE = "alive"
    PROBE = "probe"  # send the runtime's probe_request now
    HUNG = "hung"  # restart the replica


@dataclass(frozen=True)
class LivenessConfig:
    """Thresholds of the forward-progress check, in seconds.

    ``idle_probe_after_s + probe_timeout_s >= hang_after_s`` is required: an idle replica
    is then never judged faster than a busy one, so a replica whose counter moves at least
    every ``hang_after_s`` is never HUNG, whether it is idle, probed or saturated.
    """

    idle_probe_after_s: float = 30.0  # idle this long with no completion → probe
    hang_after_s: float = 60.0  # work outstanding this long with no completion → hung
    probe_timeout_s: float = 30.0  # a probe unanswered this long → hung
    # /metrics not answered at all this long → hung: a stopped or wedged server. A saturated
    # replica still answers its scrapes (vLLM's and the pyfunc server's /metrics are served by
    # their API process, apart from the engine), so this can be shorter than hang_after_s.
    unanswered_after_s: float = 20.0

    def __post_init__(self) -> None:
        for name in ("idle_probe_after_s", "hang_after_s", "probe_timeout_s", "unanswered_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.idle_probe_after_s + self.probe_timeout_s < self.hang_after_s:
            raise ValueError(
                f"idle_probe_after_s + probe_timeout_s ({self.idle_probe_after_s} + {self.probe_timeout_s}) "
                f"must be >= hang_after_s ({self.hang_after_s}): an idle replica would be judged hung "
                "sooner than a busy one")


@dataclass(frozen=True)
class LivenessState:
    """What ``decide`` remembers between looks; the initial state is ``LivenessState()``."""

    completed_total: float | None = None  # the counter at the last look (None: never looked)
    work_total: float | None = None  # the work counter at the last look
    progressed_at_s: float | None = None  # when a counter last moved (or was first seen)
    busy_since_s: float | None = None  # first look with work outstanding since the replica was idle
    probe_sent_at_s: float | None = None  # when the outstanding probe was sent (None: none)


def decide(progress: Progress, state: LivenessState, now_s: float,
           config: LivenessConfig, can_probe: bool = True) -> tuple[Verdict, LivenessState]:
    """The verdict for one look at the replica's counters, and the state for the next look.

    ``can_probe=False``: the runtime has no request to probe an idle replica with (a model
    logged with neither an input example nor a signature); an idle replica whose counters
    answer is then alive, and only busy-without-progress is a hang.
    """
    busy = progress.in_flight > 0 or progress.queued > 0
    if state.completed_total is None or progress.completed_total != state.completed_total:
        # First look, a completion, or a counter that went down (the process restarted):
        # all of them start the clock afresh and answer any outstanding probe.
        return Verdict.ALIVE, LivenessState(completed_total=progress.completed_total, work_total=progress.work_total,
                                            progressed_at_s=now_s, busy_since_s=now_s if busy else None)
    if progress.work_total != state.work_total:
        # Work done with nothing completed yet (a long generation): the hang clock restarts,
        # an outstanding probe stays outstanding (only its completion answers it).
        return Verdict.ALIVE, replace(state, work_total=progress.work_total, progressed_at_s=now_s,
                                      busy_since_s=now_s if busy else None)

    assert state.progressed_at_s is not None
    busy_since_s = (state.busy_since_s if state.busy_since_s is not None else now_s) if busy else None
    state = replace(state, busy_since_s=busy_since_s)

    if state.probe_sent_at_s is not None and now_s - state.probe_sent_at_s >= config.probe_timeout_s:
        return Verdict.HUNG, state
    if busy_since_s is not None and now_s - max(state.progressed_at_s, busy_since_s) >= config.hang_after_s:
        return Verdict.HUNG, state
    if can_probe and not busy and state.probe_sent_at_s is None and \
            now_s - state.progressed_at_s >= config.idle_probe_after_s:
        return Verdict.PROBE, replace(state, probe_sent_at_s=now_s)
    return Verdict.ALIVE, state
