"""Tokens a read of the routing table found unknown: answered 401 at once, without a read.

A request whose token is not in the routing table waits for a read of the table that began
after it arrived, so that a token created a moment ago works at once. A token that such a
read did not find is remembered here: tokens are random values the control plane makes, so
one that was unknown after it was sent stays unknown (a revoked token does not come back).
The memory is bounded (the least recently seen are forgotten first) and each entry expires,
so a stream of made-up tokens cannot grow it, and costs the database no more than the
periodic refresh (``RouterConfig.unknown_token_reread_s`` spaces the reads it asks for).

>>> now = [0.0]
>>> unknown = UnknownTokens(max_entries=2, ttl_s=60.0, clock=lambda: now[0])
>>> unknown.add("a"); unknown.add("b"); unknown.add("c")  # "a" is forgotten: at most 2
>>> [key in unknown for key in "abc"]
[False, True, True]
>>> now[0] = 61.0
>>> "b" in unknown  # expired
False
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

MAX_ENTRIES = 65_536
TTL_S = 60.0


class UnknownTokens:
    def __init__(self, max_entries: int = MAX_ENTRIES, ttl_s: float = TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._max_entries, self._ttl_s, self._clock = max_entries, ttl_s, clock

    def add(self, token_key: str) -> None:
        self._seen[token_key] = self._clock()
        self._seen.move_to_end(token_key)
        while len(self._seen) > self._max_entries:
            self._seen.popitem(last=False)

    def __contains__(self, token_key: str) -> bool:
        found_at = self._seen.get(token_key)
        if found_at is None:
            return False
        if self._clock() - found_at > self._ttl_s:
            del self._seen[token_key]
            return False
        return True


async def read_since(arrived: float, state: dict, refresh: Callable[[], Awaitable[None]], reread_s: float,
                     clock: Callable[[], float] = time.monotonic) -> None:
    """Until a read of the table that began at or after ``arrived`` has ended: the router's
    ``state`` holds ``read_at`` (when the table in use was read) and ``tried_at`` (when the
    last read began). A read begins at most ``reread_s`` after the last one began, and
    ``refresh`` joins a read under way instead of starting a second; its errors propagate."""
    while state["read_at"] < arrived:
        wait_s = state["tried_at"] + reread_s - clock()
        if state["tried_at"] < arrived and wait_s > 0:
            await asyncio.sleep(wait_s)
            continue
        await refresh()
