"""Puts usage records on the usage topic, sealed by their reporter and keyed by request id.

Every record of one request lands on one partition, in the order it was produced; the
producer is the reporter's own idempotent one, so a retried send is never a second copy.
A record Kafka cannot take is logged and counted as lost, never retried in a loop: the
aggregate would dedupe a retry, but a reporter that waits on billing would stall its streams.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka.errors import KafkaError
from prometheus_client import Counter

from shared import wire
from shared.producer import Producer
from shared.rate_limits import LogThrottle, Rate, held_back
from shared.seal import Seal

log = logging.getLogger(__name__)

LOST_LOG_RATE = Rate(per_s=0.2, burst=3)


class UsagePublisher:
    def __init__(self, producer: Producer, seal: Seal, topic: str, records: Counter) -> None:
        self._producer = producer
        self._seal = seal
        self._topic = topic
        self._records = records  # labelled by outcome: sent | lost
        self._lost_log = LogThrottle(LOST_LOG_RATE, time.monotonic())

    async def publish(self, record: wire.UsageRecord | None) -> None:
        """Queue the record (None: nothing to bill); its delivery is watched, not awaited."""
        if record is None:
            return
        try:
            delivery = await self._producer.send(
                self._topic, self._seal.encode(self._topic, record), key=record.request_id.encode()
            )
        except KafkaError as exc:
            self._lost(record, exc)
            return
        delivery.add_done_callback(lambda done: self._delivered(done, record))

    def _delivered(self, delivery: asyncio.Future, record: wire.UsageRecord) -> None:
        if delivery.cancelled() or delivery.exception() is not None:
            self._lost(record, delivery.exception() if not delivery.cancelled() else None)
        else:
            self._records.labels("sent").inc()

    def _lost(self, record: wire.UsageRecord, exc: BaseException | None) -> None:
        self._records.labels("lost").inc()
        if (held := self._lost_log.admit(time.monotonic())) is not None:
            log.warning("the usage record of %s was lost: %r%s", record.request_id, exc, held_back(held))
