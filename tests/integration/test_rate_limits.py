"""Tenants' rate limits and slot caps against the real Redis Cluster, from two limiters at once
(two edges): never over the rate by more than one bucket, also when the edges' clocks disagree,
and slots that come free when their edge stops renewing them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from services.edge.rate_limiter import TAKE, Buckets, RateLimiter, bucket_key
from services.edge.tenant_leases import Leases
from services.edge.tenants import Limits
from shared.redis_client import make_cluster
from shared.service_settings import RedisSettings

ROOT = Path(__file__).resolve().parents[2]
RPM, BURST_S = 1200, 0.5  # 20 requests a second, a bucket of 10
LIMITS = Limits(requests_per_min=RPM)
BUCKET = RPM * BURST_S / 60
SECONDS = 3.0


@pytest.fixture
async def edges(infra):
    """Two cluster clients, as two edges have."""
    nodes = RedisSettings(nodes=f"{infra.redis_host}:{infra.redis_ports[0]}")
    clients = [make_cluster(nodes), make_cluster(nodes)]
    for client in clients:  # the slot map read before the burst, not by the burst's first command
        await client.initialize()
    yield clients
    for client in clients:
        await client.aclose()


def fresh_tenant() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


async def hammer(take, seconds: float) -> int:
    """Ask as fast as one edge can for `seconds`; the number admitted."""
    admitted, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await take() is None:
            admitted += 1
        await asyncio.sleep(0.002)
    return admitted


async def test_two_edges_together_never_exceed_the_rate_by_more_than_one_bucket(edges):
    tenant = fresh_tenant()
    limiters = [RateLimiter(client, BURST_S) for client in edges]
    started = time.monotonic()
    counts = await asyncio.gather(*(hammer(lambda lim=lim: lim.take(tenant, LIMITS, 0), SECONDS) for lim in limiters))
    elapsed = time.monotonic() - started
    allowed = RPM / 60 * elapsed + BUCKET
    assert sum(counts) <= allowed + 1, (counts, allowed)
    assert sum(counts) >= 0.8 * RPM / 60 * SECONDS, counts  # and the rate is really granted
    assert min(counts) > 0  # both edges were served


async def test_a_refusal_says_when_the_bucket_has_refilled(edges):
    tenant = fresh_tenant()
    limiter = RateLimiter(edges[0], BURST_S)
    assert [await limiter.take(tenant, LIMITS, 0) for _ in range(int(BUCKET))] == [None] * int(BUCKET)
    wait_ms = await limiter.take(tenant, LIMITS, 0)
    assert wait_ms is not None and 1 <= wait_ms <= 60_000 / RPM + 5
    await asyncio.sleep(wait_ms / 1000 + 0.02)
    assert await limiter.take(tenant, LIMITS, 0) is None


async def test_tokens_per_minute_charge_prompt_and_max_tokens_and_a_big_chat_leaves_debt(edges):
    tenant = fresh_tenant()
    limits = Limits(tokens_per_min=60_000)  # 1,000 a second; a bucket of 500 at half a second
    limiter = RateLimiter(edges[0], BURST_S)
    assert await limiter.take(tenant, limits, 400) is None
    wait_ms = await limiter.take(tenant, limits, 400)  # 100 left: 300 more take 0.3 s
    assert wait_ms is not None and 250 <= wait_ms <= 320
    await asyncio.sleep(0.6)  # full again
    assert await limiter.take(tenant, limits, 5_000) is None  # over the bucket: admitted once it is full...
    wait_ms = await limiter.take(tenant, limits, 1)
    assert wait_ms is not None and wait_ms >= 4_400  # ...and the debt is paid before the next


async def test_no_limit_costs_nothing(edges):
    tenant = fresh_tenant()
    limiter = RateLimiter(edges[0], BURST_S)
    assert all([await limiter.take(tenant, Limits(), 10**9) is None for _ in range(50)])
    assert await edges[0].exists(bucket_key(tenant)) == 0


# Clock skew -------------------------------------------------------------------------------
# The same bucket fed by each edge's own clock: what the script must not do.
EDGE_CLOCK_TAKE = TAKE.replace(
    "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)",
    "local now = tonumber(ARGV[6])",
)


async def test_buckets_fed_by_the_edges_clocks_overrun_when_they_are_skewed(edges):
    """The failure the server's clock prevents: edge B, 30 s ahead, refills the bucket on every call."""
    assert EDGE_CLOCK_TAKE != TAKE
    tenant = fresh_tenant()
    buckets = Buckets.of(LIMITS, BURST_S)
    args = [buckets.request_rate, buckets.request_capacity, buckets.token_rate, buckets.token_capacity, 0]

    def taker(client, skew_s: float):
        script = client.register_script(EDGE_CLOCK_TAKE)

        async def take() -> int | None:
            now_ms = (time.time() + skew_s) * 1000
            admitted, wait = await script(keys=[bucket_key(tenant)], args=[*map(repr, map(float, args)), repr(now_ms)])
            return None if int(admitted) else int(wait)

        return take

    started = time.monotonic()
    counts = await asyncio.gather(hammer(taker(edges[0], 0.0), SECONDS), hammer(taker(edges[1], 30.0), SECONDS))
    allowed = RPM / 60 * (time.monotonic() - started) + BUCKET
    assert sum(counts) > 2 * allowed, (counts, allowed)


SKEWED_EDGE = """
import asyncio, json, sys, time
real_time, real_mono = time.time, time.monotonic
t0, m0 = real_time(), real_mono()
# This process's clocks run 30 s ahead and three times too fast.
time.time = lambda: t0 + 30 + 3 * (real_time() - t0)
time.monotonic = lambda: m0 + 30 + 3 * (real_mono() - m0)
from services.edge.rate_limiter import RateLimiter
from services.edge.tenants import Limits
from shared.redis_client import make_cluster
from shared.service_settings import RedisSettings

async def main():
    nodes, tenant, rpm, burst_s, seconds = sys.argv[1:6]
    redis = make_cluster(RedisSettings(nodes=nodes))
    limiter = RateLimiter(redis, float(burst_s))
    admitted, deadline = 0, real_mono() + float(seconds)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    deadline = real_mono() + float(seconds)
    while real_mono() < deadline:
        if await limiter.take(tenant, Limits(requests_per_min=int(rpm)), 0) is None:
            admitted += 1
        await asyncio.sleep(0.002)
    await redis.aclose()
    print(json.dumps({"admitted": admitted}), flush=True)

asyncio.run(main())
"""


async def test_an_edge_whose_clock_is_skewed_cannot_lift_the_tenants_rate(edges, infra):
    tenant = fresh_tenant()
    nodes = f"{infra.redis_host}:{infra.redis_ports[0]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [nodes, tenant, str(RPM), str(BURST_S), str(SECONDS)]
    skewed = subprocess.Popen(
        [sys.executable, "-c", SKEWED_EDGE, *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert json.loads(await asyncio.to_thread(skewed.stdout.readline)) == {"ready": True}
        started = time.monotonic()
        skewed.stdin.write("go\n")
        skewed.stdin.flush()
        here = await hammer(lambda: RateLimiter(edges[0], BURST_S).take(tenant, LIMITS, 0), SECONDS)
        there = json.loads(await asyncio.to_thread(skewed.stdout.readline))["admitted"]
        elapsed = time.monotonic() - started
    finally:
        skewed.kill()
        skewed.wait(10)
    allowed = RPM / 60 * elapsed + BUCKET
    assert here + there <= allowed + 1, (here, there, allowed)
    assert there > 0 and here > 0


# Slots (concurrent streams, connections) -------------------------------------------------
async def test_two_edges_share_a_tenants_cap_exactly(edges):
    tenant = fresh_tenant()
    a, b = Leases(edges[0], "streams", 15.0), Leases(edges[1], "streams", 15.0)
    tries = [lease.acquire(tenant, f"{edge}-r{i}", 3) for i in range(10) for edge, lease in (("a", a), ("b", b))]
    taken = await asyncio.gather(*tries)
    assert sum(taken) == 3
    assert await a.count(tenant) == 3
    holder, member = (a, next(iter(a.held))) if a.held else (b, next(iter(b.held)))
    await holder.release(member)
    assert await b.acquire(tenant, "late", 3)  # a slot given back is free at once, on any edge
    assert not await a.acquire(tenant, "later", 3)
    await holder.release(member)  # a second release of the same slot is a no-op


async def test_a_crashed_edges_slots_come_free_and_a_live_edges_are_kept(edges):
    tenant = fresh_tenant()
    crashed, live, other = (
        Leases(edges[0], "streams", 1.5),
        Leases(edges[1], "streams", 1.5),
        Leases(edges[1], "streams", 1.5),
    )
    assert await crashed.acquire(tenant, "c1", 2)
    assert await live.acquire(tenant, "l1", 2)
    assert not await other.acquire(tenant, "o1", 2)
    for _ in range(4):  # 2 s: the live edge renews, the crashed one does not
        await asyncio.sleep(0.5)
        await live.renew()
    assert await other.acquire(tenant, "o1", 2)  # the crashed edge's slot expired
    assert not await other.acquire(tenant, "o2", 2)  # the live one's did not
    assert await live.count(tenant) == 2


async def test_a_stream_resumed_on_another_edge_keeps_its_slot_when_the_old_edge_lets_go(edges):
    tenant = fresh_tenant()
    old, new = Leases(edges[0], "streams", 15.0), Leases(edges[1], "streams", 15.0)
    assert await old.acquire(tenant, "r1", 1)
    await new.adopt(tenant, "r1")
    assert await new.count(tenant) == 1  # one stream, one slot, wherever it is held
    await old.release("r1")  # the old edge's resume grace ran out
    await new.renew()
    assert await new.count(tenant) == 1
    assert not await old.acquire(tenant, "r2", 1)
