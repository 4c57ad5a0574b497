"""A tenant's slots under a cap (concurrent streams, connections), shared by every edge.

Each slot is an entry of a sorted set per tenant in the Redis Cluster, scored by when it
expires (the Redis server's clock, inside the scripts). The edge holding a slot renews it
every `lease_refresh_s`; an edge that crashed stops renewing, and its slots come free
`lease_s` later. Taking a slot is one atomic script: drop expired entries, count, add.
A slot may move between edges (a resumed stream): the new edge adopts it, and should the
old one still release it, the new one's next renewal puts it back.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from redis.asyncio.cluster import RedisCluster

from shared.redis_client import REDIS_UNAVAILABLE

log = logging.getLogger(__name__)

# KEYS[1]: the tenant's set. ARGV: member, cap, lease ms. 1 if the member holds a slot now, else 0.
ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
redis.call('PEXPIRE', KEYS[1], lease)
return 1
"""

# KEYS[1]: the tenant's set. ARGV: lease ms, members... Every member's lease starts again now.
RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], now + lease, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], lease)
return #ARGV - 1
"""

# KEYS[1]: the tenant's set. The number of live slots.
COUNT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""


def slots_key(kind: str, tenant: str) -> str:
    return f"slots:{kind}:{{{tenant}}}"


class Leases:
    """The slots of one kind ("streams", "connections") this edge holds, by member id.

    Only members taken under a cap are held: a tenant without a cap costs no Redis call.
    """

    def __init__(self, redis: RedisCluster, kind: str, lease_s: float) -> None:
        self.kind = kind
        self._lease_ms = max(1, round(lease_s * 1000))
        self._acquire = redis.register_script(ACQUIRE)
        self._renew = redis.register_script(RENEW)
        self._count = redis.register_script(COUNT)
        self._redis = redis
        self.held: dict[str, str] = {}  # member -> tenant

    async def acquire(self, tenant: str, member: str, cap: int) -> bool:
        """Take a slot; False if the tenant already holds `cap` (0: no cap, nothing is held)."""
        if cap <= 0:
            return True
        taken = await self._acquire(keys=[slots_key(self.kind, tenant)], args=[member, cap, self._lease_ms])
        if int(taken):
            self.held[member] = tenant
        return bool(int(taken))

    async def adopt(self, tenant: str, member: str) -> None:
        """Hold a slot taken elsewhere (a stream resumed here), whatever the count."""
        self.held[member] = tenant
        await self._renew(keys=[slots_key(self.kind, tenant)], args=[self._lease_ms, member])

    async def release(self, member: str) -> None:
        """Give a slot back; a member not held is a no-op, so every ending may call this."""
        tenant = self.held.pop(member, None)
        if tenant is None:
            return
        try:
            await self._redis.zrem(slots_key(self.kind, tenant), member)
        except REDIS_UNAVAILABLE as exc:
            log.debug("%s slot %s left to expire: %r", self.kind, member, exc)

    async def count(self, tenant: str) -> int:
        """Live slots of the tenant over every edge."""
        return int(await self._count(keys=[slots_key(self.kind, tenant)]))

    async def renew(self) -> None:
        """Start every held slot's lease again; one script per tenant."""
        by_tenant: dict[str, list[str]] = defaultdict(list)
        for member, tenant in list(self.held.items()):
            by_tenant[tenant].append(member)
        results = await asyncio.gather(
            *(self._renew(keys=[slots_key(self.kind, t)], args=[self._lease_ms, *ms]) for t, ms in by_tenant.items()),
            return_exceptions=True,
        )
        if failed := [r for r in results if isinstance(r, BaseException)]:
            log.warning("could not renew %d tenants' %s slots: %r", len(failed), self.kind, failed[0])
