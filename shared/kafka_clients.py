"""Kafka clients with the settings this system relies on, in one place.

aiokafka's defaults suit throughput, not a token stream: producers here wait for all
in-sync replicas with idempotence on (no loss, no duplicates on retry), consumers
commit by hand after the work is handed on, and fetches return after a few
milliseconds instead of half a second.
"""

from __future__ import annotations

import logging

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord

from shared import wire

log = logging.getLogger(__name__)

# How long a fetch may wait for data on a quiet partition; each hop adds up to this.
FETCH_MAX_WAIT_MS = 5


def make_producer(bootstrap: str, client_id: str) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        client_id=client_id,
        acks="all",
        enable_idempotence=True,
        linger_ms=0,
        request_timeout_ms=10_000,
    )


def make_consumer(
    bootstrap: str,
    *topics: str,
    client_id: str,
    group_id: str | None,
    auto_offset_reset: str = "earliest",
) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        client_id=client_id,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset=auto_offset_reset,
        fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
        session_timeout_ms=6_000,  # the broker's minimum: a dead consumer's partitions move on sooner
        heartbeat_interval_ms=1_000,
        max_poll_records=1_000,
    )


async def send_dead_letter(
    producer: AIOKafkaProducer, topic: str, record: ConsumerRecord, consumer: str, reason: str
) -> None:
    """Park a message nobody can use, with the reason, so it is never retried in a loop."""
    log.warning("dead-lettering %s[%d]@%d: %s", record.topic, record.partition, record.offset, reason)
    letter = wire.DeadLetter(record.topic, record.partition, record.offset, consumer, reason, record.value or b"")
    await producer.send_and_wait(topic, wire.encode(letter))
