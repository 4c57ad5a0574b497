"""The Redis batcher against the real cluster: calls made together share one pipeline, calls made
while it is in flight wait for the next, and a pipeline that fails fails every caller in it, only them."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.exceptions import ResponseError

from shared.redis_batcher import RedisBatcher
from shared.redis_client import make_cluster
from shared.service_settings import RedisSettings


@pytest.fixture
async def counted(infra):
    """The cluster client, counting the pipelines opened on it."""
    redis = make_cluster(RedisSettings(nodes=f"{infra.redis_host}:{infra.redis_ports[0]}"))
    redis.pipelines_opened = 0
    open_pipeline = redis.pipeline

    def counting(*args, **kwargs):
        redis.pipelines_opened += 1
        return open_pipeline(*args, **kwargs)

    redis.pipeline = counting
    yield redis
    await redis.aclose()


async def test_calls_made_together_share_a_pipeline_and_later_ones_the_next(counted):
    batcher = RedisBatcher(counted)
    keys = [f"batcher:{{{uuid.uuid4().hex}}}" for _ in range(50)]
    first = [asyncio.create_task(batcher.run(lambda pipe, k=k: pipe.set(k, "1", ex=60))) for k in keys[:25]]
    await asyncio.sleep(0)  # the first pipeline is on its way
    second = [asyncio.create_task(batcher.run(lambda pipe, k=k: pipe.set(k, "2", ex=60))) for k in keys[25:]]
    await asyncio.gather(*first, *second)
    assert counted.pipelines_opened == 2
    assert list(await asyncio.gather(*map(counted.get, keys))) == ["1"] * 25 + ["2"] * 25


async def test_a_failed_pipeline_fails_every_caller_in_it_and_the_next_one_works(counted):
    batcher = RedisBatcher(counted)
    text, fine = f"batcher:{{{uuid.uuid4().hex}}}", f"batcher:{{{uuid.uuid4().hex}}}"
    await counted.set(text, "not a number", ex=60)
    calls = [
        batcher.run(lambda pipe: pipe.incr(text)),  # WRONGTYPE-like: the value is no integer
        batcher.run(lambda pipe: pipe.set(fine, "x", ex=60)),
        batcher.run(lambda pipe: pipe.set(fine + "2", "y", ex=60)),
    ]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, ResponseError) for r in results), results
    assert counted.pipelines_opened == 1
    await batcher.run(lambda pipe: pipe.set(fine, "again", ex=60))  # the batcher is not stuck
    assert await counted.get(fine) == "again" and counted.pipelines_opened == 2
