"""Usage metering while fleet processes are killed: every request the client saw end is counted
once, with what the client saw, whoever died."""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import time
import urllib.request
import uuid

import pytest

from shared import wire
from shared.metering.ledger import Ledger
from shared.metering.pricing import Tokens
from shared.models.echo import count_prompt_pieces
from shared.redis_client import make_cluster
from shared.service_settings import RedisSettings
from tests.fault.conftest import TEXT, finish, intact, start_streams

STREAMS = 20
SETTLED_WITHIN_S = 30.0  # past a consumer session timeout and the rebalance after it


@pytest.fixture
def tenant(monkeypatch) -> str:
    """The fleet's dev key, for a tenant of its own: earlier runs' counters are not in its sums."""
    name = f"kill-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("DRIVETRAIN_API_KEYS", f"dev-key:{name}")
    monkeypatch.setenv("DRIVETRAIN_TENANT_TIERS", f"{name}:pro")
    return name


def busiest_worker(fleet) -> str:
    """The worker computing the most requests, by its /metrics, once the streams are running."""
    deadline = time.monotonic() + 10.0
    while True:
        running = {}
        for i in range(2):
            with urllib.request.urlopen(f"http://127.0.0.1:{fleet.spec.worker_metrics_port(i)}/metrics", timeout=5) as page:
                found = re.search(r"^drivetrain_worker_running_requests ([0-9.e+]+)$", page.read().decode(), re.M)
            running[f"worker-{i}"] = float(found[1]) if found else 0.0
        if sum(running.values()) >= STREAMS or time.monotonic() > deadline:
            return max(running, key=running.get)
        time.sleep(0.1)


async def totals_of(tenant: str) -> Tokens:
    redis = make_cluster(RedisSettings())
    try:
        now = dt.datetime.now(dt.UTC)
        return (await Ledger(redis).totals(tenant, now - dt.timedelta(hours=2), now)).get("pro", Tokens())
    finally:
        await redis.aclose()


async def settled_totals(tenant: str, expected: Tokens) -> Tokens:
    """The tenant's counters once they reach `expected` (or the deadline passes), then a while longer:
    a duplicate counted late would show."""
    deadline = time.monotonic() + SETTLED_WITHIN_S
    while await totals_of(tenant) != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    await asyncio.sleep(3.0)
    return await totals_of(tenant)


async def test_no_request_is_counted_twice_after_a_router_is_killed(make_fleet, tenant):
    name = tenant
    fleet = make_fleet(edges=1, routers=2, workers=1, echo_delay_ms=20)
    url = fleet.spec.chat_url(0)
    early, _ = await start_streams(url, STREAMS // 2, words=20)  # these end, and are counted, around the kill
    late, _ = await start_streams(url, STREAMS // 2)
    await asyncio.sleep(0.3)
    fleet.kill("router-0")
    results = await finish(early + late, timeout=60)
    assert all(r.final["type"] == "done" for r in results), [r.final for r in results]
    assert all(intact(r) for r in results[STREAMS // 2 :])
    usages = [r.final["usage"] for r in results]
    expected = Tokens(
        prompt=sum(u["prompt_tokens"] for u in usages),
        cached=sum(u["cached_tokens"] for u in usages),
        completion=sum(u["completion_tokens"] for u in usages),
        requests=STREAMS,
    )
    assert await settled_totals(name, expected) == expected


async def test_no_request_is_counted_twice_or_lost_after_a_worker_is_killed(make_fleet, tenant):
    name = tenant
    fleet = make_fleet(edges=1, routers=1, workers=2, echo_delay_ms=20)
    sockets, _ = await start_streams(fleet.spec.chat_url(0), STREAMS)
    await asyncio.sleep(1.0)  # every stream has tokens out (each runs 3 s)
    fleet.kill(busiest_worker(fleet))  # placement may put these alike prompts all on one worker
    results = await finish(sockets)
    done = [r for r in results if r.final["type"] == "done"]
    lost = [r for r in results if r.final["type"] == "error" and r.final["code"] == "worker_lost"]
    # A stream still without a token when its worker died is quarantined, and not billed.
    unbilled = [r for r in results if r.final["type"] == "error" and r.final["code"] == "request_quarantined"]
    assert lost and len(done) + len(lost) + len(unbilled) == STREAMS
    assert all(r.tokens for r in lost) and not any(r.tokens for r in unbilled)
    # The edge bills a lost stream for the tokens its client got and the prompt as the edge counted it,
    # which for the echo model is the engine's count too.
    prompt = count_prompt_pieces([wire.Message("user", TEXT)])
    assert all(r.final["usage"]["prompt_tokens"] == prompt for r in done)
    expected = Tokens(
        prompt=prompt * (len(done) + len(lost)),
        cached=sum(r.final["usage"]["cached_tokens"] for r in done),
        completion=sum(r.final["usage"]["completion_tokens"] for r in done) + sum(len(r.tokens) for r in lost),
        requests=len(done) + len(lost),
    )
    assert await settled_totals(name, expected) == expected
