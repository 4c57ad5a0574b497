"""Kafka clients with the settings this system relies on, in one place.

aiokafka's defaults suit throughput, not a token stream: producers here wait for all
in-sync replicas with idempotence on (no loss, no duplicates on retry), and consumers
commit by hand after the work is handed on.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from aiokafka.errors import KafkaError

from shared import wire
from shared.producer import Producer
from shared.rate_limits import LogThrottle, Rate, held_back
from shared.service_settings import KafkaSettings
from shared.topics import MAX_RECORD_BYTES

log = logging.getLogger(__name__)

DEAD_LETTER_LOG_RATE = Rate(per_s=1.0, burst=10)  # a flood of poison must not become a flood of log lines
# A broker that takes no record and fails none (one that stops answering) holds the parking
# consumer's loop no longer than this; the record is skipped all the same.
PARK_WITHIN_S = 5.0

# How long the broker may hold a fetch that finds no data. It adds no latency: a held fetch is
# answered as soon as a record arrives on any of its partitions (fetch_min_bytes is 1). It sets
# how often an idle consumer asks again: at 5 ms each one burnt ~13 % of a core on empty
# fetches (measured on the 2-core dev machine), at 100 ms ~1.4 %. A request queued behind a held
# fetch on the same connection (a metadata or offset lookup) waits up to this, once.
FETCH_MAX_WAIT_MS = 100


def make_producer(kafka: KafkaSettings, client_id: str) -> Producer:
    return Producer(
        lambda: AIOKafkaProducer(
            bootstrap_servers=kafka.bootstrap,
            **kafka.client_options(),
            client_id=client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=0,
            request_timeout_ms=10_000,
            max_request_size=MAX_RECORD_BYTES,  # a request as large as the edge's largest frame
        )
    )


def make_consumer(
    kafka: KafkaSettings,
    *topics: str,
    client_id: str,
    group_id: str | None,
    auto_offset_reset: str = "earliest",
) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=kafka.bootstrap,
        **kafka.client_options(),
        client_id=client_id,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset=auto_offset_reset,
        fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
        session_timeout_ms=6_000,  # the broker's minimum: a dead consumer's partitions move on sooner
        heartbeat_interval_ms=1_000,
        max_poll_records=1_000,
    )


class DeadLetters:
    """Parks the records a consumer cannot use, with the reason, so none is ever retried in a loop."""

    def __init__(self, producer: Producer, topic: str, consumer: str) -> None:
        self._producer = producer
        self._topic = topic
        self._consumer = consumer
        self._log = LogThrottle(DEAD_LETTER_LOG_RATE, time.monotonic())

    async def park(self, record: ConsumerRecord, reason: str) -> None:
        if (held := self._log.admit(time.monotonic())) is not None:
            log.warning(
                "dead-lettering %s[%d]@%d: %s%s",
                record.topic, record.partition, record.offset, reason, held_back(held),
            )
        letter = wire.DeadLetter(record.topic, record.partition, record.offset, self._consumer, reason, record.value or b"")
        try:
            async with asyncio.timeout(PARK_WITHIN_S):
                await self._producer.send_and_wait(self._topic, wire.encode(letter))
        except (KafkaError, TimeoutError) as exc:  # the broker is away or silent: the record is skipped all the same
            log.warning("could not park %s[%d]@%d: %r", record.topic, record.partition, record.offset, exc)
