"""Prometheus plumbing shared by the services: gossip and Kafka-lag collectors.

Each service keeps its metrics in its own registry (no process-global state); the edge
serves it on its HTTP port at /metrics, workers and routers on their metrics port
(shared/status_server.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from collections.abc import Iterator

from aiokafka import AIOKafkaConsumer
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.membership import Membership

log = logging.getLogger(__name__)

LAG_PERIOD_S = 2.0


class GossipCollector(Collector):
    """Members by role and status, dropped gossip packets by reason, and membership events no
    listener took in time, read at scrape time."""

    def __init__(self, membership: Membership) -> None:
        self._membership = membership

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        members = GaugeMetricFamily("drivetrain_gossip_members", "Members in this node's view", labels=["role", "status"])
        for (role, status), count in Tally((m.role, str(m.status)) for m in self._membership.members()).items():
            members.add_metric([role, status], count)
        yield members
        drops = CounterMetricFamily("drivetrain_gossip_dropped_packets", "Gossip packets dropped", labels=["reason"])
        for reason, count in self._membership.drops().items():
            drops.add_metric([reason], count)
        yield drops
        yield CounterMetricFamily(
            "drivetrain_gossip_events_dropped", "Membership events dropped because a listener's queue was full",
            value=self._membership.events_dropped,
        )


def watch_consumer_lag(consumer: AIOKafkaConsumer, registry: CollectorRegistry) -> asyncio.Task:
    """A task that keeps `drivetrain_kafka_consumer_lag` (messages not yet consumed) up to date."""
    lag = Gauge("drivetrain_kafka_consumer_lag", "Messages behind the end of each partition", ["topic", "partition"], registry=registry)

    async def update() -> None:
        while True:
            await asyncio.sleep(LAG_PERIOD_S)
            for tp in consumer.assignment():
                highwater = consumer.highwater(tp)
                if highwater is not None:
                    lag.labels(tp.topic, str(tp.partition)).set(max(0, highwater - await consumer.position(tp)))

    return asyncio.create_task(update(), name="consumer-lag")
