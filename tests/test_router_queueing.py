"""The per-endpoint concurrency gate: first in first out, bounded queue and wait, no slot lost to a cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.router.errors import RouterError
from serving.router.queueing import ConcurrencyGate


def run(coroutine):
    return asyncio.run(coroutine)


async def settle() -> None:
    """Let every ready task run until it blocks again."""
    for _ in range(5):
        await asyncio.sleep(0)


async def queue_up(gate: ConcurrencyGate, count: int, log: list, hold: asyncio.Event | None = None,
                   ) -> list[asyncio.Task]:
    """``count`` requests, started one after another so that they queue in that order."""
    async def request(i):
        async with gate.slot():
            log.append(i)
            if hold is not None:
                await hold.wait()
    tasks = []
    for i in range(count):
        tasks.append(asyncio.ensure_future(request(i)))
        await settle()
    return tasks


def test_runs_at_once_below_the_limit_and_waiters_go_first_in_first_out():
    async def scenario():
        gate, order = ConcurrencyGate(2, 10, 5.0), []
        await gate.acquire()
        await gate.acquire()
        assert (gate.running, gate.waiting) == (2, 0)
        tasks = await queue_up(gate, 5, order)
        assert (gate.running, gate.waiting, order) == (2, 5, [])
        gate.release()
        newcomer = asyncio.ensure_future(gate.acquire())  # arrives after the release: must not overtake
        await settle()
        assert order == [0, 1, 2, 3, 4] and not newcomer.done()  # each hands its slot to the next
        gate.release()
        await newcomer
        gate.release()
        await asyncio.gather(*tasks)
        return gate.running, gate.waiting
    assert run(scenario()) == (0, 0)


def test_a_full_queue_refuses_at_once_with_429_and_retry_after():
    async def scenario():
        gate = ConcurrencyGate(1, 2, 5.0, name="endpoint 'gec'")
        await gate.acquire()
        tasks = await queue_up(gate, 2, [])
        with pytest.raises(RouterError) as refused:
            await gate.acquire()
        assert (gate.running, gate.waiting) == (1, 2)  # the refusal changed nothing
        gate.release()
        await asyncio.gather(*tasks)
        return refused.value
    refused = run(scenario())
    assert refused.status == 429 and refused.headers == {"Retry-After": "1"}
    assert str(refused) == "endpoint 'gec' has 1 requests running and 2 waiting, its limit; retry after 1 s"


def test_no_queue_refuses_every_request_beyond_the_limit():
    async def scenario():
        gate = ConcurrencyGate(1, 0, 5.0)
        await gate.acquire()
        with pytest.raises(RouterError) as refused:
            await gate.acquire()
        return refused.value.status
    assert run(scenario()) == 429


def test_a_waiter_without_a_slot_after_max_wait_gets_503_and_leaves_the_queue():
    async def scenario():
        gate = ConcurrencyGate(1, 5, 0.05, name="endpoint 'gec'", retry_after_s=2)
        await gate.acquire()
        started = time.monotonic()
        with pytest.raises(RouterError) as timed_out:
            await gate.acquire()
        return timed_out.value, time.monotonic() - started, gate.running, gate.waiting
    error, waited_s, running, waiting = run(scenario())
    assert error.status == 503 and error.headers == {"Retry-After": "2"}
    assert "endpoint 'gec' waited 0.05 s for a free slot" in str(error)
    assert waited_s >= 0.05 and (running, waiting) == (1, 0)


def test_a_cancelled_waiter_leaves_the_queue_and_takes_no_slot():
    async def scenario():
        gate = ConcurrencyGate(1, 5, 5.0)
        await gate.acquire()
        tasks = await queue_up(gate, 2, [])
        tasks[0].cancel()
        await settle()
        assert (gate.running, gate.waiting, len(gate._waiters)) == (1, 1, 1)  # its future left the queue too
        gate.release()
        await tasks[1]
        return gate.running, gate.waiting, tasks[0].cancelled()
    assert run(scenario()) == (0, 0, True)


def test_a_slot_handed_to_a_waiter_that_is_being_cancelled_passes_to_the_next():
    async def scenario():
        gate, order, hold = ConcurrencyGate(1, 5, 5.0), [], asyncio.Event()
        await gate.acquire()
        tasks = await queue_up(gate, 2, order, hold)
        gate.release()  # hands the slot to waiter 0 ...
        tasks[0].cancel()  # ... which is cancelled before it could run
        await settle()
        assert order == [1] and (gate.running, gate.waiting) == (1, 0)
        hold.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        return gate.running, gate.waiting
    assert run(scenario()) == (0, 0)


def test_a_waiter_cancelled_at_the_head_of_the_queue_does_not_block_it():
    async def scenario():
        gate, order = ConcurrencyGate(1, 5, 5.0), []
        await gate.acquire()
        tasks = await queue_up(gate, 2, order)
        tasks[0].cancel()  # its future is cancelled now, its task runs later
        assert gate.waiting == 1  # and it no longer counts as waiting
        gate.release()  # in the same instant: the slot must skip the dead waiter
        await settle()
        await asyncio.gather(*tasks, return_exceptions=True)
        return order, gate.running, gate.waiting
    assert run(scenario()) == ([1], 0, 0)


def test_raising_the_limit_lets_waiters_in_and_lowering_it_interrupts_no_one():
    async def scenario():
        gate, order, hold = ConcurrencyGate(1, 10, 5.0), [], asyncio.Event()
        await gate.acquire()
        tasks = await queue_up(gate, 4, order, hold)
        gate.update(3, 10, 5.0)
        await settle()
        assert (order, gate.running, gate.waiting) == ([0, 1], 3, 2)
        gate.update(1, 10, 5.0)
        gate.release()  # running 3 -> 2, still above the new limit of 1: no one enters
        await settle()
        assert (order, gate.running, gate.waiting) == ([0, 1], 2, 2)
        hold.set()
        await asyncio.gather(*tasks)
        return order, gate.running, gate.waiting
    assert run(scenario()) == ([0, 1, 2, 3], 0, 0)


def test_release_without_acquire_is_a_bug_that_is_reported():
    with pytest.raises(RuntimeError):
        ConcurrencyGate(1, 1, 1.0).release()


requests = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.one_of(st.none(), st.integers(0, 8))),
                    min_size=1, max_size=25)


@given(max_concurrent=st.integers(1, 4), max_queued=st.integers(0, 6), requests=requests)
@settings(max_examples=60)
def test_whatever_is_cancelled_or_refused_no_slot_leaks_and_the_limit_holds(max_concurrent, max_queued, requests):
    """Each request: (start after ms, hold ms, cancelled after ms or never)."""
    async def scenario():
        gate, inside, most_inside, outcomes = ConcurrencyGate(max_concurrent, max_queued, 0.004), 0, 0, []

        async def request(start_ms, hold_ms):
            nonlocal inside, most_inside
            await asyncio.sleep(start_ms / 1000)
            try:
                async with gate.slot():
                    inside += 1
                    most_inside = max(most_inside, inside)
                    try:
                        await asyncio.sleep(hold_ms / 1000)
                    finally:
                        inside -= 1
                outcomes.append("ran")
            except RouterError as refused:
                outcomes.append(refused.status)

        tasks = [asyncio.ensure_future(request(start_ms, hold_ms)) for start_ms, hold_ms, _ in requests]
        for task, (_, _, cancel_ms) in zip(tasks, requests):
            if cancel_ms is not None:
                asyncio.get_running_loop().call_later(cancel_ms / 1000, task.cancel)
        await asyncio.gather(*tasks, return_exceptions=True)
        cancelled = sum(task.cancelled() for task in tasks)
        return gate.running, gate.waiting, most_inside, len(outcomes) + cancelled, set(outcomes)
    running, waiting, most_inside, ended, outcomes = run(scenario())
    assert (running, waiting) == (0, 0)
    assert most_inside <= max_concurrent
    assert ended == len(requests) and outcomes <= {"ran", 429, 503}


steps = st.lists(st.tuples(st.sampled_from(["arrive", "finish", "cancel", "cancel_soon", "settle"]), st.integers(0, 7)),
                 max_size=60)


@given(max_concurrent=st.integers(1, 3), max_queued=st.integers(0, 4), steps=steps)
@settings(max_examples=300)
def test_same_instant_releases_and_cancellations_leak_nothing_and_leave_no_slot_idle(max_concurrent, max_queued, steps):
    """Steps run back to back without yielding, except "settle"; "cancel_soon" cancels in the loop's next
    round, right after the releases that "finish" set off, so a slot can be handed to a waiter in the
    instant it is cancelled (where it would be lost if not passed on). ``(action, k)`` acts on the k-th
    request not yet ended, modulo their number."""
    async def scenario():
        gate = ConcurrencyGate(max_concurrent, max_queued, 2.0)
        tasks: list[asyncio.Task] = []
        finish: list[asyncio.Event] = []
        inside: set[int] = set()

        async def request(i):
            async with gate.slot():
                inside.add(i)
                try:
                    await finish[i].wait()
                finally:
                    inside.discard(i)

        def check():
            assert len(inside) <= gate.running <= max_concurrent
            assert gate.waiting <= max_queued
            assert gate.waiting == 0 or gate.running == max_concurrent  # no slot idle while someone waits

        for action, k in steps:
            if action == "arrive":
                finish.append(asyncio.Event())
                tasks.append(asyncio.ensure_future(request(len(tasks))))
            elif action == "settle":
                await settle()
                check()
            elif live := [i for i, task in enumerate(tasks) if not task.done()]:
                i = live[k % len(live)]
                if action == "finish":
                    finish[i].set()
                elif action == "cancel":
                    tasks[i].cancel()
                elif action == "cancel_soon":
                    asyncio.get_running_loop().call_soon(tasks[i].cancel)
        await settle()
        check()
        for event in finish:
            event.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        return gate.running, gate.waiting
    assert run(scenario()) == (0, 0)
