"""The warm pool's decision, apart from its processes: which zygotes to stop, which keys to start one for.

:func:`plan` is level-triggered: given the zygotes there are and the keys wanted, it says what to
change; :class:`~cluster.local.warm_pool.WarmPool` gathers the facts and applies the result.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from controlplane.backoff import restart_delay_s


class LaunchLike(Protocol):
    """What the pool needs of a replica launch (:class:`~serving.runtime.base.ReplicaLaunch`)."""

    argv: list[str]
    env: dict[str, str]  # added to this process's environment (replica_environment)



@dataclass(frozen=True)
class PoolKey:
    """Zygotes are interchangeable within a key: same runtime kind, same interpreter."""

    kind: str  # a runtime name with a zygote kind: "vllm", "pyfunc"
    python: str  # the interpreter path as a replica's argv[0] names it (a venv's python, unresolved)

    @classmethod
    def for_launch(cls, kind: str, launch: LaunchLike) -> PoolKey:
        return cls(kind=kind, python=os.path.abspath(launch.argv[0]))


@dataclass(frozen=True)
class WarmPoolConfig:
    size_per_kind: int = 1  # ready zygotes per key once the key is used; 0 turns the pool off
    start_timeout_s: float = 300.0  # zygote start to ready (a vLLM import takes 10-30 s on 2 busy cores)
    refill_delay_s: float = 60.0  # after a start or take, before a key's next zygote starts
    poll_interval_s: float = 0.5  # the background reconcile loop
    assign_timeout_s: float = 10.0  # a zygote acknowledges an assignment within this
    failure_backoff_initial_s: float = 5.0  # after a zygote fails to start: 5, 10, 20 … s
    failure_backoff_max_s: float = 600.0
    log_dir: Path | None = None  # where a zygote's output waits until assignment; None: a temporary dir
    cwd: Path | None = None  # the zygotes' cwd; None: this process's (a cold replica's, and so a warm one's)

    def __post_init__(self) -> None:
        problems = [f"{name} must be ≥ 0, got {getattr(self, name)}"
                    for name in ("size_per_kind", "refill_delay_s", "failure_backoff_initial_s")
                    if getattr(self, name) < 0]
        problems += [f"{name} must be > 0, got {getattr(self, name)}"
                     for name in ("start_timeout_s", "poll_interval_s", "assign_timeout_s") if getattr(self, name) <= 0]
        if self.failure_backoff_max_s < self.failure_backoff_initial_s:
            problems.append("failure_backoff_max_s must be ≥ failure_backoff_initial_s")
        if problems:
            raise ValueError("invalid warm pool config: " + "; ".join(problems))




@dataclass(frozen=True)
class KeyState:
    """What the pool wants for one key: zygotes for ``profile_env``, none before ``not_before_s``."""

    profile_env: Mapping[str, str]  # what the key's last replica launch added to the environment
    not_before_s: float = 0.0  # refill delay after a start, or backoff after failures
    failures: int = 0  # zygotes in a row that died or timed out before ready


@dataclass(frozen=True)
class ZygoteView:
    id: int
    key: PoolKey
    started_s: float
    alive: bool
    ready: bool
    fits: bool = True  # a ready zygote accepts the key's profile environment (starting ones: unknown, True)


@dataclass(frozen=True)
class PoolPlan:
    start: tuple[PoolKey, ...] = ()
    stop: tuple[tuple[int, str], ...] = ()  # (zygote id, why)


# Why plan() stops a zygote; the first two count as failures to start (backed off).
EXITED_BEFORE_READY, NOT_READY = "exited before it was ready", "not ready within start_timeout_s"
EXITED_IDLE, NOT_WANTED, STALE, SURPLUS = ("exited while idle", "its key is no longer warmed",
                                           "the key's environment changed", "more than size_per_kind")


def plan(wanted: Mapping[PoolKey, KeyState], zygotes: Sequence[ZygoteView], now_s: float,
         config: WarmPoolConfig) -> PoolPlan:
    """Which zygotes to stop and which keys to start one for, so that each wanted key has ``size_per_kind``.

    >>> key, config = PoolKey("pyfunc", "/venv/bin/python"), WarmPoolConfig(size_per_kind=1, start_timeout_s=60)
    >>> plan({key: KeyState({}, not_before_s=10.0)}, [], now_s=5.0, config=config)  # refill delay not over
    PoolPlan(start=(), stop=())
    >>> plan({key: KeyState({}, not_before_s=10.0)}, [], now_s=10.0, config=config).start
    (PoolKey(kind='pyfunc', python='/venv/bin/python'),)
    >>> plan({key: KeyState({})}, [ZygoteView(7, key, started_s=0.0, alive=False, ready=True)], 1.0, config)
    PoolPlan(start=(PoolKey(kind='pyfunc', python='/venv/bin/python'),), stop=((7, 'exited while idle'),))
    """
    stop: list[tuple[int, str]] = []
    kept: dict[PoolKey, list[ZygoteView]] = {}
    for z in zygotes:
        if not z.alive:
            stop.append((z.id, EXITED_IDLE if z.ready else EXITED_BEFORE_READY))
        elif z.key not in wanted or config.size_per_kind == 0:
            stop.append((z.id, NOT_WANTED))
        elif not z.ready and now_s - z.started_s > config.start_timeout_s:
            stop.append((z.id, NOT_READY))
        elif not z.fits:
            stop.append((z.id, STALE))
        else:
            kept.setdefault(z.key, []).append(z)
    start: list[PoolKey] = []
    for key, state in wanted.items():
        live = sorted(kept.get(key, []), key=lambda z: (not z.ready, z.started_s))
        stop += [(z.id, SURPLUS) for z in live[config.size_per_kind:]]
        missing = config.size_per_kind - len(live)
        if missing > 0 and now_s >= state.not_before_s:
            start += [key] * missing
    return PoolPlan(start=tuple(start), stop=tuple(stop))


def after_failure(state: KeyState, now_s: float, config: WarmPoolConfig) -> KeyState:
    """A zygote of this key failed to start: back off before the next.

    >>> after_failure(KeyState({}, failures=2), 100.0, WarmPoolConfig(failure_backoff_initial_s=5.0))
    KeyState(profile_env={}, not_before_s=120.0, failures=3)
    """
    failures = state.failures + 1
    delay_s = restart_delay_s(failures, config.failure_backoff_initial_s, config.failure_backoff_max_s)
    return KeyState(state.profile_env, max(state.not_before_s, now_s + delay_s), failures)


# ---- processes -------------------------------------------------------------------------------
