"""The routing map against the real Redis Cluster: a burst of writes goes out in a few pipelines."""

from __future__ import annotations

import asyncio
import uuid

from shared.redis_client import make_cluster
from shared.routing_map import Route, RoutingMap
from shared.service_settings import RedisSettings


async def test_a_burst_of_routes_is_written_in_few_pipelines_and_read_back(infra):
    redis = make_cluster(RedisSettings(nodes=f"{infra.redis_host}:{infra.redis_ports[0]}"))
    pipelines = 0
    open_pipeline = redis.pipeline

    def counting_pipeline(*args, **kwargs):
        nonlocal pipelines
        pipelines += 1
        return open_pipeline(*args, **kwargs)

    redis.pipeline = counting_pipeline
    try:
        routes = RoutingMap(redis)
        ids = [uuid.uuid4().hex for _ in range(200)]
        await asyncio.gather(*(routes.put(rid, Route("edge-x", f"conn-{i}"), "t", "secret") for i, rid in enumerate(ids)))
        assert pipelines <= 5, f"{pipelines} pipelines for one burst of 200 writes"
        fresh = RoutingMap(redis)  # no cache: everything from Redis
        found = await fresh.get_many(ids)
        assert [found[rid].conn_id for rid in ids] == [f"conn-{i}" for i in range(200)]
        assert await fresh.check_resume(ids[0], "t", "secret")
        assert not await fresh.check_resume(ids[0], "t", "wrong")
        assert not await fresh.check_resume(ids[0], "other-tenant", "secret")
        await asyncio.gather(*(routes.delete(rid) for rid in ids[:100]))
        assert set(await RoutingMap(redis).get_many(ids)) == set(ids[100:])
        assert await routes.move(ids[150], "edge-y", "conn-new") == (1, Route("edge-x", "conn-150", 0))
        assert (await RoutingMap(redis).get_many([ids[150]]))[ids[150]] == Route("edge-y", "conn-new", 1)
    finally:
        await redis.aclose()
