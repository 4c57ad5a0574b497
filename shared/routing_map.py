"""The routing map: request id -> (edge, connection), in the Redis Cluster.

Each request's key carries its id as a hash tag, so everything about one request
lives in one slot while requests spread over all masters.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachetools import LRUCache
from redis.asyncio.cluster import RedisCluster

ROUTE_TTL_S = 3600


@dataclass(frozen=True)
class Route:
    edge_id: str
    conn_id: str


def route_key(request_id: str) -> str:
    return f"route:{{{request_id}}}"


class RoutingMap:
    """Writes go straight to Redis; reads go through a local cache first.

    A route only changes when a stream is resumed on another connection, which
    invalidates the cached entry explicitly.
    """

    def __init__(self, redis: RedisCluster, cache_size: int = 100_000) -> None:
        self._redis = redis
        self._cache: LRUCache[str, Route] = LRUCache(maxsize=cache_size)
        self.num_cache_hits = 0
        self.num_cache_misses = 0

    async def put(self, request_id: str, route: Route, tenant: str) -> None:
        key = route_key(request_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={"edge": route.edge_id, "conn": route.conn_id, "tenant": tenant})
            pipe.expire(key, ROUTE_TTL_S)
            await pipe.execute()

    async def delete(self, request_id: str) -> None:
        self._cache.pop(request_id, None)
        await self._redis.delete(route_key(request_id))

    def forget(self, request_id: str) -> None:
        self._cache.pop(request_id, None)

    async def get_many(self, request_ids: list[str]) -> dict[str, Route]:
        """Routes of the given requests; unknown ones are absent from the result."""
        found: dict[str, Route] = {}
        missing: list[str] = []
        for request_id in dict.fromkeys(request_ids):
            route = self._cache.get(request_id)
            if route is None:
                missing.append(request_id)
            else:
                found[request_id] = route
        self.num_cache_hits += len(found)
        self.num_cache_misses += len(missing)
        if missing:
            async with self._redis.pipeline(transaction=False) as pipe:
                for request_id in missing:
                    pipe.hmget(route_key(request_id), ["edge", "conn"])
                rows = await pipe.execute()
            for request_id, (edge_id, conn_id) in zip(missing, rows):
                if edge_id and conn_id:
                    found[request_id] = self._cache[request_id] = Route(edge_id, conn_id)
        return found
