"""Rate limits: token buckets, alone or one per key, and a log line a flood cannot multiply.

Pure: the clock is passed in, so tests step time by hand. The edge keeps one bucket per
connection (frames) and one per client address (refused handshakes); services keep one
per kind of log line that outside input can cause (refusals, bad link frames, dead letters).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Rate:
    """`per_s` on average, bursts of up to `burst` at once."""

    per_s: float
    burst: float


class TokenBucket:
    def __init__(self, rate: Rate, now: float) -> None:
        self.rate = rate
        self._tokens = rate.burst
        self._at = now

    def tokens(self, now: float) -> float:
        return min(self.rate.burst, self._tokens + max(0.0, now - self._at) * self.rate.per_s)

    def take(self, now: float, cost: float = 1.0) -> bool:
        """Spend `cost` if the bucket holds it; False (and nothing spent) otherwise."""
        self._tokens, self._at = self.tokens(now), now
        if self._tokens < cost:
            return False
        self._tokens -= cost
        return True

    def is_full(self, now: float) -> bool:
        return self.tokens(now) >= self.rate.burst


class KeyedBuckets:
    """One bucket per key, for at most `max_keys` keys.

    A full bucket is the same as no bucket, so it is dropped; past `max_keys` the key
    least recently charged goes first. Memory stays bounded however many addresses
    a flood comes from; a forgotten key at worst gets a fresh burst.
    """

    def __init__(self, rate: Rate, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def allows(self, key: str, now: float) -> bool:
        """Whether `key` has a token left, without spending one."""
        bucket = self._buckets.get(key)
        return bucket is None or bucket.tokens(now) >= 1.0

    def charge(self, key: str, now: float) -> bool:
        """Spend one of `key`'s tokens; False when it had none left."""
        bucket = self._buckets.pop(key, None) or TokenBucket(self.rate, now)
        allowed = bucket.take(now)
        self._buckets[key] = bucket
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return allowed

    def sweep(self, now: float) -> None:
        """Forget the keys whose buckets have refilled."""
        for key in [k for k, b in self._buckets.items() if b.is_full(now)]:
            del self._buckets[key]

    def __len__(self) -> int:
        return len(self._buckets)


def held_back(held: int) -> str:
    """What a throttled log line adds about the lines held back before it."""
    return f" ({held} similar lines not logged)" if held else ""


class LogThrottle:
    """At most `rate` lines; each line that gets out says how many were held back before it."""

    def __init__(self, rate: Rate, now: float) -> None:
        self._bucket = TokenBucket(rate, now)
        self._held = 0

    def admit(self, now: float) -> int | None:
        """None: do not log this one. Otherwise log it, with this many held back since the last."""
        if not self._bucket.take(now):
            self._held += 1
            return None
        held, self._held = self._held, 0
        return held
