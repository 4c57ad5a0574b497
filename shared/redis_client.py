"""The Redis Cluster client every service uses (redis-py asyncio, following MOVED/ASK itself)."""

from __future__ import annotations

import asyncio
import logging

from pydantic import SecretStr
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from shared.service_settings import RedisSettings

log = logging.getLogger(__name__)

DISCOVER_WITHIN_S = 5.0  # a start waits no longer for a cluster that does not answer

# What a call to the cluster raises while a node dies or fails over: redis-py's errors, the
# socket's, and the RuntimeError uvloop raises for a write to a connection the server has just
# closed, which redis-py passes on as it is (it once stopped a router's usage aggregate for good).
REDIS_UNAVAILABLE = (RedisError, OSError, RuntimeError)


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


async def discover(cluster: RedisCluster) -> None:
    """Learn the cluster's nodes and commands now, before a request needs them. redis-py does it at a
    client's first command: ~50 ms here (CLUSTER SLOTS, and COMMAND's whole table parsed), which the
    first chat through a freshly started fleet waited for once in each service on its path (the
    edge's route write, the worker's start record, the router's route lookup). Best effort: a cluster
    that does not answer yet is learnt at first use, as before."""
    try:
        async with asyncio.timeout(DISCOVER_WITHIN_S):
            await cluster.initialize()
    except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
        log.warning("the Redis Cluster did not answer at start (%r); its nodes are learnt at first use", exc)
