"""Usage metering on a live fleet: one record per finished request, its counts the client's `done`
frame's, the tenant's counters in the Redis Cluster their sum, `drivetrain usage` their price; and a
usage topic full of junk does not stop the aggregate."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
from aiokafka import AIOKafkaProducer

from services.launcher.fleet import Fleet
from shared import wire
from shared.chat_client import ChatSocket
from shared.codes import FinishReason
from shared.metering.ledger import Ledger
from shared.metering.pricing import Tokens
from shared.redis_client import make_cluster
from shared.service_settings import RedisSettings
from tests.conftest import FLEET_SEAL, KafkaTap, start_fleet

TENANT = f"meter-{uuid.uuid4().hex[:8]}"
KEY = f"key-{uuid.uuid4().hex}"
COUNTED_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def fleet(topics, fleet_logs) -> Iterator[Fleet]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRIVETRAIN_API_KEYS", f"{KEY}:{TENANT},dev-key:dev")
        patch.setenv("DRIVETRAIN_TENANT_TIERS", f"{TENANT}:pro")
        fleet = start_fleet(topics, fleet_logs, edges=1, routers=2, workers=1, model="echo", echo_delay_ms=5)
    yield fleet
    fleet.stop()


async def totals_of(tenant: str) -> dict[str, Tokens]:
    redis = make_cluster(RedisSettings())
    try:
        now = dt.datetime.now(dt.UTC)
        return await Ledger(redis).totals(tenant, now - dt.timedelta(hours=2), now)
    finally:
        await redis.aclose()


async def wait_for_totals(tenant: str, expected: dict[str, Tokens]) -> dict[str, Tokens]:
    deadline = time.monotonic() + COUNTED_WITHIN_S
    while (found := await totals_of(tenant)) != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return found


async def test_each_request_is_billed_once_with_what_its_done_frame_said(fleet, infra, topics):
    texts = ["one two three", "a b c d e f g h", "hello there", "x " * 40]
    async with KafkaTap(infra, topics.usage, topics.usage_partitions) as tap:
        sock = await ChatSocket.open(fleet.spec.chat_url(), api_key=KEY)
        try:
            for i, text in enumerate(texts):
                await sock.chat(f"c{i}", text, max_tokens=5 if i == 3 else 100)
            ids = {f"c{i}": (await sock.next_frame(f"c{i}"))["request_id"] for i in range(len(texts))}
            results = {chat_id: await sock.collect(chat_id) for chat_id in ids}
        finally:
            await sock.close()
        done = {ids[c]: r.final for c, r in results.items()}
        assert all(f["type"] == "done" for f in done.values())
        seen: dict[str, list[wire.UsageRecord]] = {}
        deadline = time.monotonic() + COUNTED_WITHIN_S
        while set(seen) != set(done) and time.monotonic() < deadline:
            for record in await tap.messages(wire.UsageRecord, 0.5):
                seen.setdefault(record.request_id, []).append(record)
    assert set(seen) == set(done)
    for request_id, frame in done.items():
        (record,) = seen[request_id]
        usage = frame["usage"]
        assert (record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (
            usage["prompt_tokens"], usage["cached_tokens"], usage["completion_tokens"]
        )
        assert (record.tenant, record.tier, record.finish_reason) == (TENANT, "pro", frame["finish_reason"])
        assert record.reporter == record.worker_id and record.created_at <= record.finished_at
    assert seen[ids["c3"]][0].finish_reason == FinishReason.LENGTH and seen[ids["c3"]][0].completion_tokens == 5

    expected = Tokens(
        prompt=sum(f["usage"]["prompt_tokens"] for f in done.values()),
        cached=sum(f["usage"]["cached_tokens"] for f in done.values()),
        completion=sum(f["usage"]["completion_tokens"] for f in done.values()),
        requests=len(done),
    )
    assert await wait_for_totals(TENANT, {"pro": expected}) == {"pro": expected}

    report = subprocess.run(
        [sys.executable, "-m", "services.cli", "usage", "--tenant", TENANT, "--since", "2h", "--json",
         "--billing.tier-prices", "pro:2/10"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    (row,) = json.loads(report.stdout)["usage"]
    assert (row["tenant"], row["tier"], row["requests"]) == (TENANT, "pro", len(done))
    assert row["completion_tokens"] == expected.completion
    price = (expected.computed * 2 + expected.cached * 2 * 0.1 + expected.completion * 10) / 1e6
    assert row["total_cost"] == pytest.approx(price, abs=1e-6)


async def test_a_cancelled_stream_is_billed_for_what_it_did(fleet, infra, topics):
    tenant_record = []
    async with KafkaTap(infra, topics.usage, topics.usage_partitions) as tap:
        sock = await ChatSocket.open(fleet.spec.chat_url(), api_key=KEY)
        try:
            await sock.chat("long", " ".join(f"w{i}" for i in range(2000)), max_tokens=2000)
            request_id = (await sock.next_frame("long"))["request_id"]
            await sock.next_frame("long")  # a token
            await sock.send({"type": "cancel", "id": "long"})
            result = await sock.collect("long")
        finally:
            await sock.close()
        deadline = time.monotonic() + COUNTED_WITHIN_S
        while not tenant_record and time.monotonic() < deadline:
            tenant_record = [r for r in await tap.messages(wire.UsageRecord, 0.5) if r.request_id == request_id]
    assert result.final["type"] == "done" and result.final["finish_reason"] == "cancelled"
    (record,) = tenant_record
    assert record.finish_reason == FinishReason.CANCELLED
    assert record.completion_tokens == result.final["usage"]["completion_tokens"] > 0


async def test_junk_on_the_usage_topic_is_dead_lettered_and_counting_goes_on(fleet, infra, topics):
    tenant = f"junk-{uuid.uuid4().hex[:8]}"
    now = time.time()
    good = wire.UsageRecord(
        f"r-{uuid.uuid4().hex}", tenant, "free", 10, 0, 3, "test", "worker-x", now, now, finish_reason=FinishReason.STOP,
    )
    forged = wire.UsageRecord(good.request_id + "-f", tenant, "free", 99, 0, 99, "worker-0", "worker-0", now, now, finish_reason=FinishReason.STOP)
    impossible = wire.UsageRecord(good.request_id + "-i", tenant, "free", 1, 5, 1, "test", "w", now, now, finish_reason=FinishReason.STOP)
    junk = [
        None, b"", b"\xff\x00garbage",
        FLEET_SEAL.encode(topics.usage, wire.Cancel(["r"])),  # the wrong schema
        FLEET_SEAL.encode(topics.usage, forged),  # sealed by "test", claims worker-0
        FLEET_SEAL.encode(topics.usage, impossible),  # more cached than prompt
        FLEET_SEAL.encode(topics.tokens, good),  # sealed for another topic
    ]
    producer = AIOKafkaProducer(bootstrap_servers=infra.kafka_bootstrap)
    await producer.start()
    try:
        async with KafkaTap(infra, topics.dead_letter, topics.dead_letter_partitions) as letters:
            for value in junk:
                await producer.send_and_wait(topics.usage, value, key=good.request_id.encode())
            for _ in range(2):  # the second copy must add nothing
                await producer.send_and_wait(topics.usage, FLEET_SEAL.encode(topics.usage, good), key=good.request_id.encode())
            expected = {"free": Tokens(prompt=10, cached=0, completion=3, requests=1)}
            assert await wait_for_totals(tenant, expected) == expected
            parked: list[wire.DeadLetter] = []
            deadline = time.monotonic() + COUNTED_WITHIN_S
            while len(parked) < len(junk) and time.monotonic() < deadline:
                letters_now = [wire.decode(value, wire.DeadLetter) for value in await letters.records(0.5)]  # not sealed
                parked += [m for m in letters_now if m.source_topic == topics.usage]
    finally:
        await producer.stop()
    assert len(parked) == len(junk)
    await asyncio.sleep(1.0)
    assert await totals_of(tenant) == expected
