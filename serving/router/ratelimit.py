"""Rate limits as token buckets (pure: the caller passes ``now``, monotonic seconds).

A bucket holds at most ``burst`` tokens and gains ``rate_per_s`` tokens a second::

    tokens(now) = min(burst, tokens(updated_s) + rate_per_s × (now − updated_s))

A request brings one :class:`Charge` per limit that applies to it — its endpoint's requests
per second, its endpoint's model units per second, its token's requests per second — keyed
``(scope, key)``, e.g. ``("endpoint_requests", "gec")`` or ``("token_requests", "<token id>")``.
:meth:`Limiter.admit` is atomic: it takes ``amount`` tokens from every bucket, or from none.

A refusal says how long to wait, exactly: the time until every refused bucket holds ``amount``
tokens, ``max((amount − tokens(now)) / rate_per_s)``. The router sends it as ``Retry-After``
in whole seconds, rounded up, at least 1 (429). A charge above its bucket's ``burst`` can never
be admitted, however long the caller waits: that decision has ``never=True`` (413).

Worked example: 2 requests/s, burst 2. At t = 0 two requests take both tokens; a third finds
0 and must wait (1 − 0) / 2 = 0.5 s, sent as ``Retry-After: 1``; at t = 0.5 it is admitted.

>>> limiter = Limiter()
>>> gec = Charge(("endpoint_requests", "gec"), rate_per_s=2.0, burst=2.0, amount=1.0)
>>> [limiter.admit([gec], now=0.0).admitted for _ in range(2)]
[True, True]
>>> third = limiter.admit([gec], now=0.0)
>>> third.admitted, third.retry_after_s, third.limit, third.retry_after_header
(False, 0.5, 'endpoint gec: 2 requests/s', '1')
>>> limiter.admit([gec], now=0.5).admitted
True

A spec edit that changes a limit's rate or burst is picked up by its existing bucket at the
next charge: the bucket keeps its tokens, capped at the new burst. Buckets idle long enough to
be full again are the same as new ones, so they are dropped when more than ``max_buckets``
exist (memory stays bounded by the number of recently busy keys).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from serving.router.errors import RouterError

BucketKey = tuple[str, str]  # (scope, key), e.g. ("endpoint_units", "gec")

# A wait shorter than this is float rounding, not a limit: without it, admitting at exactly
# ``now + retry_after_s`` could fail by 1e-16 tokens. It lets a bucket run at most
# ``rate_per_s × WAIT_TOLERANCE_S`` tokens below zero, once, never cumulatively.
WAIT_TOLERANCE_S = 1e-6

SCOPES = {  # scope -> (what the key names, what the amount counts), for messages
    "endpoint_requests": ("endpoint", "requests"),
    "endpoint_units": ("endpoint", "model units"),
    "token_requests": ("token", "requests"),
    "token_units": ("token", "model units"),
}


def describe_limit(bucket_key: BucketKey, rate_per_s: float) -> str:
    """A limit as a person reads it.

    >>> describe_limit(("endpoint_requests", "gec"), 5.0)
    'endpoint gec: 5 requests/s'
    >>> describe_limit(("token_units", "tok_12"), 0.5)
    'token tok_12: 0.5 model units/s'
    """
    subject, unit = SCOPES.get(bucket_key[0], (bucket_key[0], "units"))
    return f"{subject} {bucket_key[1]}: {rate_per_s:g} {unit}/s"


def retry_after_whole_s(wait_s: float) -> int:
    """A wait as ``Retry-After`` sends it: whole seconds, rounded up, at least 1.

    >>> retry_after_whole_s(0.5), retry_after_whole_s(2.0), retry_after_whole_s(2.01)
    (1, 2, 3)
    """
    return max(1, math.ceil(wait_s))


@dataclass
class TokenBucket:
    rate_per_s: float  # tokens gained per second
    burst: float  # capacity, in tokens
    tokens: float  # as of updated_s (may be a rounding error below 0, see WAIT_TOLERANCE_S)
    updated_s: float

    def tokens_at(self, now: float) -> float:
        return min(self.burst, self.tokens + self.rate_per_s * max(0.0, now - self.updated_s))


@dataclass(frozen=True)
class Charge:
    """Take ``amount`` tokens from the bucket ``bucket_key``, whose limit is ``rate_per_s`` with ``burst``."""

    bucket_key: BucketKey
    rate_per_s: float
    burst: float
    amount: float = 1.0

    def __post_init__(self) -> None:
        if not (self.rate_per_s > 0 and self.burst > 0 and self.amount >= 0):
            raise ValueError(f"a limit needs rate_per_s > 0 and burst > 0 and a charge amount >= 0; got {self}")


@dataclass(frozen=True)
class Decision:
    admitted: bool
    retry_after_s: float = 0.0  # exact wait until the refused buckets hold enough; 0 when admitted or never
    limit: str = ""  # the refusing limit, e.g. "endpoint gec: 5 requests/s"
    never: bool = False  # the request costs more than the limit's burst: waiting cannot help (413)
    message: str = ""  # for the person who sent the request

    @property
    def retry_after_header(self) -> str:
        """``Retry-After`` in whole seconds: the wait rounded up, at least 1."""
        return str(retry_after_whole_s(self.retry_after_s))

    def error(self) -> RouterError | None:
        """What the router answers: None when admitted, 413 when never admissible, else 429 with Retry-After."""
        if self.admitted:
            return None
        if self.never:
            return RouterError(413, self.message)
        return RouterError(429, self.message, {"Retry-After": self.retry_after_header})


class Limiter:
    """Token buckets keyed by (scope, key); see the module docstring."""

    def __init__(self, max_buckets: int = 10_000) -> None:
        self._buckets: dict[BucketKey, TokenBucket] = {}
        self._max_buckets = max_buckets
        self._sweep_above = max_buckets  # doubles when a sweep frees little, so sweeps stay amortized O(1)

    def __len__(self) -> int:
        return len(self._buckets)

    def bucket(self, bucket_key: BucketKey) -> TokenBucket | None:
        """The bucket's state (for metrics and tests); None when absent, which means full."""
        return self._buckets.get(bucket_key)

    def admit(self, charges: Sequence[Charge], now: float) -> Decision:
        """Charge every bucket or none (charges to one key add up)."""
        amounts: dict[BucketKey, float] = {}
        limits: dict[BucketKey, Charge] = {}
        for charge in charges:
            amounts[charge.bucket_key] = amounts.get(charge.bucket_key, 0.0) + charge.amount
            limits[charge.bucket_key] = charge
        for key, amount in amounts.items():
            charge = limits[key]
            if amount > charge.burst:
                limit = describe_limit(key, charge.rate_per_s)
                unit = SCOPES.get(key[0], ("", "units"))[1]
                return Decision(False, limit=limit, never=True, message=(
                    f"this request costs {amount:g} {unit} while the limit {limit} allows at most {charge.burst:g} "
                    "at once; retrying cannot help: send a smaller request or ask for a higher limit"))
        buckets = {key: self._bucket_for(limits[key], now) for key in amounts}
        wait_s, refusing = 0.0, None
        for key, amount in amounts.items():
            bucket = buckets[key]
            key_wait_s = max(0.0, (amount - bucket.tokens_at(now)) / bucket.rate_per_s)
            if key_wait_s > WAIT_TOLERANCE_S and key_wait_s > wait_s:
                wait_s, refusing = key_wait_s, key
        if refusing is not None:  # nothing was taken: a refusal leaves every bucket as it was
            limit = describe_limit(refusing, buckets[refusing].rate_per_s)
            return Decision(False, retry_after_s=wait_s, limit=limit, message=(
                f"rate limit reached: {limit}; retry after {retry_after_whole_s(wait_s)} s"))
        for key, amount in amounts.items():
            bucket = buckets[key]
            bucket.tokens, bucket.updated_s = bucket.tokens_at(now) - amount, now
        return Decision(True)

    def _bucket_for(self, charge: Charge, now: float) -> TokenBucket:
        bucket = self._buckets.get(charge.bucket_key)
        if bucket is None:
            if len(self._buckets) >= self._sweep_above:
                self._sweep(now)
            bucket = self._buckets[charge.bucket_key] = TokenBucket(charge.rate_per_s, charge.burst, charge.burst, now)
        elif (bucket.rate_per_s, bucket.burst) != (charge.rate_per_s, charge.burst):  # the spec was edited
            bucket.tokens, bucket.updated_s = min(charge.burst, bucket.tokens_at(now)), now
            bucket.rate_per_s, bucket.burst = charge.rate_per_s, charge.burst
        return bucket

    def _sweep(self, now: float) -> None:
        """Drop full buckets: a full bucket behaves exactly like a new one."""
        for key in [key for key, bucket in self._buckets.items() if bucket.tokens_at(now) >= bucket.burst]:
            del self._buckets[key]
        self._sweep_above = max(self._max_buckets, 2 * len(self._buckets))
