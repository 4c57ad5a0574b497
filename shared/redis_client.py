"""The Redis Cluster client every service uses (redis-py asyncio, following MOVED/ASK itself)."""

from __future__ import annotations

from pydantic import SecretStr
from redis.asyncio.cluster import ClusterNode, RedisCluster

from shared.service_settings import RedisSettings


def make_cluster(redis: RedisSettings) -> RedisCluster:
    """A client of the cluster `redis` names, logged in as its user when it has one."""
    password = redis.password.get_secret_value() if isinstance(redis.password, SecretStr) else None
    return RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in redis.startup_nodes()],
        username=redis.username,
        password=password,
        ssl=redis.ssl,
        ssl_ca_certs=str(redis.ssl_ca_certs) if redis.ssl_ca_certs else None,
        decode_responses=True,
        # Each node's pool raises at once when full instead of waiting: callers
        # bound their own concurrency, so this is a ceiling, not a queue.
        max_connections=200,
    )
