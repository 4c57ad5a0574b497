"""The usage aggregate on a real broker and Redis Cluster, a fault put into its ledger just after
a count lands: a connection that closed under a write is retried, and a failure no handler foresaw
costs a restart from the last commit, never the counting for good. Either way each request is
counted once."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio.cluster import RedisCluster

from services.router.metering import UsageAggregator
from services.router.metrics import RouterMetrics
from shared import wire
from shared.codes import FinishReason
from shared.infra.command import drop_topics, fresh_topics
from shared.infra.permissions import usage_meter_group
from shared.kafka_clients import DeadLetters, make_producer
from shared.metering.ledger import Ledger
from shared.metering.pricing import Tokens
from shared.redis_client import make_cluster
from shared.seal import Seal
from shared.service_settings import KafkaSettings, RedisSettings
from shared.topics import TopicLayout
from tests.conftest import FLEET_SEAL, FLEET_SECRET

COUNTED_WITHIN_S = 30.0
# What uvloop raises for a write to a connection the server has just closed (a Redis failover).
CLOSED_UNDER_WRITE = RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")


class FaultyLedger(Ledger):
    """The real ledger, whose first count raises `fault` once it has counted."""

    def __init__(self, redis: RedisCluster, fault: Exception) -> None:
        super().__init__(redis)
        self._fault: Exception | None = fault

    async def count(self, usage: wire.UsageRecord) -> bool:
        added = await super().count(usage)
        if self._fault is not None:
            fault, self._fault = self._fault, None
            raise fault
        return added


@pytest.fixture(scope="module")
def layout(infra) -> Iterator[TopicLayout]:
    layout = fresh_topics("meter")
    yield layout
    drop_topics(layout)


@pytest.mark.parametrize(
    ("fault", "restarts"),
    [(CLOSED_UNDER_WRITE, 0), (LookupError("a fault no handler foresaw"), 1)],
    ids=["connection-closed-under-a-write", "unforeseen"],
)
async def test_a_fault_in_counting_does_not_stop_the_aggregate_nor_count_twice(infra, layout, fault, restarts):
    kafka = KafkaSettings(bootstrap=infra.kafka_bootstrap)
    redis = make_cluster(RedisSettings())
    producer = make_producer(kafka, client_id="meter-test")
    registry = CollectorRegistry()
    aggregator = UsageAggregator(
        kafka, layout, usage_meter_group(layout), "meter-test", Seal(FLEET_SECRET, "meter-test"),
        FaultyLedger(redis, fault), DeadLetters(producer, layout.dead_letter, "meter-test"), RouterMetrics(registry),
    )  # fmt: skip
    tenant = f"fault-{uuid.uuid4().hex[:8]}"
    now = time.time()
    usage = wire.UsageRecord(
        f"r-{uuid.uuid4().hex}", tenant, "free", 7, 0, 2, "test", "worker-x", now, now, finish_reason=FinishReason.STOP
    )
    expected = {"free": Tokens(prompt=7, cached=0, completion=2, requests=1)}
    stopping = asyncio.Event()
    await producer.start()
    counting = asyncio.create_task(aggregator.run(stopping))
    try:
        await producer.send_and_wait(layout.usage, FLEET_SEAL.encode(layout.usage, usage), key=usage.request_id.encode())
        # The second try, after the retry or the restart, finds the request counted and adds nothing.
        deadline = time.monotonic() + COUNTED_WITHIN_S
        while sample(registry, "usage_records_total", outcome="duplicate") < 1 and time.monotonic() < deadline:
            assert not counting.done(), counting
            await asyncio.sleep(0.2)
        assert sample(registry, "usage_records_total", outcome="duplicate") == 1
        assert sample(registry, "usage_restarts_total") == restarts
        assert await totals_of(redis, tenant) == expected
        stopping.set()
        await asyncio.wait_for(counting, COUNTED_WITHIN_S)
    finally:
        stopping.set()
        counting.cancel()
        await producer.stop()
        await redis.aclose()


async def totals_of(redis: RedisCluster, tenant: str) -> dict[str, Tokens]:
    now = dt.datetime.now(dt.UTC)
    return await Ledger(redis).totals(tenant, now - dt.timedelta(hours=2), now)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(f"drivetrain_router_{name}", labels) or 0.0
