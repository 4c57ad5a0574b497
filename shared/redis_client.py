"""The Redis Cluster client every service uses (redis-py asyncio, following MOVED/ASK itself)."""

from __future__ import annotations

from redis.asyncio.cluster import ClusterNode, RedisCluster


def make_cluster(startup_nodes: list[tuple[str, int]]) -> RedisCluster:
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in startup_nodes],
        decode_responses=True,
        # Each node's pool raises at once when full instead of waiting: callers
        # bound their own concurrency, so this is a ceiling, not a queue.
        max_connections=200,
    )
