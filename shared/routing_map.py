"""The routing map: request id -> (edge, connection), in the Redis Cluster, plus who started it.

Each request's key carries its id as a hash tag, so everything about one request
lives in one slot while requests spread over all masters. A route has an epoch that
grows each time the stream is resumed on another connection; readers that hold an
older epoch in their cache fetch the route again.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from dataclasses import dataclass

from cachetools import LRUCache
from redis.asyncio.cluster import ClusterPipeline, RedisCluster

from shared.redis_batcher import RedisBatcher

ROUTE_TTL_S = 3600


@dataclass(frozen=True)
class Route:
    edge_id: str
    conn_id: str
    epoch: int = 0


def route_key(request_id: str) -> str:
    return f"route:{{{request_id}}}"


def claim_key(request_id: str) -> str:
    # Apart from the route, which the edge deletes when the stream ends: the claim must
    # outlive it, for as long as Kafka might hand the request to another worker.
    return f"claim:{{{request_id}}}"


def token_digest(resume_token: str) -> str:
    return hashlib.sha256(resume_token.encode()).hexdigest()


class RoutingMap:
    """Writes go straight to Redis; reads go through a local cache first."""

    def __init__(self, redis: RedisCluster, cache_size: int = 100_000, max_in_flight: int = 64) -> None:
        self._redis = redis
        # redis-py's cluster client fails at once, not by waiting, once a node's pool is
        # exhausted, and misbehaves near that edge: a burst of admissions queues here instead.
        self._in_flight = asyncio.Semaphore(max_in_flight)
        self._batcher = RedisBatcher(redis)
        self._cache: LRUCache[str, Route] = LRUCache(maxsize=cache_size)
        self.num_cache_hits = 0
        self.num_cache_misses = 0

    async def put(self, request_id: str, route: Route, tenant: str, resume_token: str) -> None:
        key = route_key(request_id)
        fields = {
            "edge": route.edge_id,
            "conn": route.conn_id,
            "epoch": route.epoch,
            "tenant": tenant,
            "resume": token_digest(resume_token),
        }

        def write(pipe: ClusterPipeline) -> None:
            pipe.hset(key, mapping=fields)
            pipe.expire(key, ROUTE_TTL_S)

        await self._batcher.run(write)

    async def check_resume(self, request_id: str, tenant: str, resume_token: str) -> bool:
        """True only for the tenant holding the request's own token (compared in constant time)."""
        async with self._in_flight:
            stored_tenant, digest = await self._redis.hmget(route_key(request_id), ["tenant", "resume"])
            if digest is None:
                return False
            return hmac.compare_digest(digest, token_digest(resume_token)) and stored_tenant == tenant

    async def move(self, request_id: str, edge_id: str, conn_id: str) -> tuple[int, Route | None]:
        """Point the route at a new connection; returns its new epoch and the route it had."""
        async with self._in_flight:
            key = route_key(request_id)
            async with self._redis.pipeline(transaction=True) as pipe:  # one key: one slot, one MULTI
                pipe.hmget(key, ["edge", "conn", "epoch"])
                pipe.hincrby(key, "epoch", 1)
                pipe.hset(key, mapping={"edge": edge_id, "conn": conn_id})
                (old_edge, old_conn, old_epoch), epoch, _ = await pipe.execute()
            self._cache.pop(request_id, None)
            previous = Route(old_edge, old_conn, int(old_epoch or 0)) if old_edge and old_conn else None
            return epoch, previous

    async def claim(self, owners: dict[str, str]) -> None:
        """Record which worker started each request (request id -> worker id)."""
        async with self._in_flight:
            async with self._redis.pipeline(transaction=False) as pipe:
                for request_id, worker_id in owners.items():
                    pipe.set(claim_key(request_id), worker_id, ex=ROUTE_TTL_S)
                await pipe.execute()

    async def owners(self, request_ids: list[str]) -> dict[str, str]:
        """The claimed requests among these: request id -> the worker that started it."""
        async with self._in_flight, self._redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.get(claim_key(request_id))
            found = await pipe.execute()
        return {rid: worker for rid, worker in zip(request_ids, found) if worker}

    async def delete(self, request_id: str) -> None:
        self._cache.pop(request_id, None)
        await self._batcher.run(lambda pipe: pipe.delete(route_key(request_id)))

    async def get_many(self, request_ids: list[str], min_epochs: dict[str, int] | None = None) -> dict[str, Route]:
        """Routes of the given requests; unknown ones are absent from the result."""
        min_epochs = min_epochs or {}
        found: dict[str, Route] = {}
        missing: list[str] = []
        for request_id in dict.fromkeys(request_ids):
            route = self._cache.get(request_id)
            if route is None or route.epoch < min_epochs.get(request_id, 0):
                missing.append(request_id)
            else:
                found[request_id] = route
        self.num_cache_hits += len(found)
        self.num_cache_misses += len(missing)
        if missing:
            async with self._in_flight, self._redis.pipeline(transaction=False) as pipe:
                for request_id in missing:
                    pipe.hmget(route_key(request_id), ["edge", "conn", "epoch"])
                rows = await pipe.execute()
            for request_id, (edge_id, conn_id, epoch) in zip(missing, rows):
                if edge_id and conn_id:
                    found[request_id] = self._cache[request_id] = Route(edge_id, conn_id, int(epoch or 0))
        return found
