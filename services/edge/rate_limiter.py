"""Per-tenant rate limits as token buckets in the Redis Cluster, shared by every edge.

One hash per tenant holds both buckets (requests and tokens per minute); an atomic Lua
script refills them to now, checks both, and takes from both or from neither. "Now" is the
Redis server's TIME inside the script, never an edge's clock: every edge's charge for a
tenant runs on the master of that tenant's slot, so skewed edge clocks cannot add refill.
Tokens are charged at admission as prompt tokens + max_tokens (what the chat may use).
A chat costing more tokens than the bucket holds is admitted when the bucket is full and
leaves it in debt, so it waits no longer than its cost needs and the rate still holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio.cluster import RedisCluster

from services.edge.tenants import Limits

# KEYS[1]: the tenant's bucket hash. ARGV: request rate per ms, request capacity,
# token rate per ms, token capacity, token cost. A capacity of 0 is no limit.
# Returns {1, 0} when admitted, else {0, ms until both buckets could take the chat}.
TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local req_rate, req_cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local tok_rate, tok_cap, cost = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local held = redis.call('HMGET', KEYS[1], 'req', 'tok', 'at')
local elapsed = math.max(0, now - (tonumber(held[3]) or now))
local req = math.min(req_cap, (tonumber(held[1]) or req_cap) + elapsed * req_rate)
local tok = math.min(tok_cap, (tonumber(held[2]) or tok_cap) + elapsed * tok_rate)
local wait = 0
if req_cap > 0 and req < 1 then wait = math.max(wait, (1 - req) / req_rate) end
local need = math.min(cost, tok_cap)
if tok_cap > 0 and tok < need then wait = math.max(wait, (need - tok) / tok_rate) end
if wait > 0 then return {0, math.ceil(wait)} end
if req_cap > 0 then req = req - 1 end
if tok_cap > 0 then tok = tok - cost end
local full_in = 0
if req_cap > 0 then full_in = math.max(full_in, (req_cap - req) / req_rate) end
if tok_cap > 0 then full_in = math.max(full_in, (tok_cap - tok) / tok_rate) end
redis.call('HSET', KEYS[1], 'req', tostring(req), 'tok', tostring(tok), 'at', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(full_in) + 1000)
return {1, 0}
"""


def bucket_key(tenant: str) -> str:
    return f"rate:{{{tenant}}}"


@dataclass(frozen=True)
class Buckets:
    """A tenant's two buckets, per millisecond; a capacity of 0 is no limit of that kind."""

    request_rate: float = 0.0
    request_capacity: float = 0.0
    token_rate: float = 0.0
    token_capacity: float = 0.0

    @classmethod
    def of(cls, limits: Limits, burst_s: float) -> Buckets:
        rpm, tpm = limits.requests_per_min, limits.tokens_per_min
        return cls(
            rpm / 60_000,
            max(1.0, rpm * burst_s / 60) if rpm else 0.0,
            tpm / 60_000,
            max(1.0, tpm * burst_s / 60) if tpm else 0.0,
        )

    @property
    def unlimited(self) -> bool:
        return not self.request_capacity and not self.token_capacity


class RateLimiter:
    """`take` one chat of `tokens` from the tenant's buckets: None if admitted, else ms to wait."""

    def __init__(self, redis: RedisCluster, burst_s: float) -> None:
        self._script = redis.register_script(TAKE)
        self._burst_s = burst_s

    async def take(self, tenant: str, limits: Limits, tokens: int) -> int | None:
        buckets = Buckets.of(limits, self._burst_s)
        if buckets.unlimited:
            return None
        args = [buckets.request_rate, buckets.request_capacity, buckets.token_rate, buckets.token_capacity, tokens]
        admitted, wait_ms = await self._script(keys=[bucket_key(tenant)], args=[repr(float(a)) for a in args])
        return None if int(admitted) else max(1, int(wait_ms))
