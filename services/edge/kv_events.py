"""The edge's reader of the kv-events topic: every edge reads every worker's KV-cache events (no
consumer group, from the latest offset) into its KV index. A record that is not a sealed
`KvEvents` from a fleet member is dead-lettered and skipped; nothing on the topic stops the edge.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError

from services.edge.kv_index import KVIndex
from shared import wire
from shared.kafka_clients import DeadLetters
from shared.seal import Seal

log = logging.getLogger(__name__)

POLL_TIMEOUT_MS = 200
RETRY_S = 1.0


async def consume_kv_events(consumer: AIOKafkaConsumer, seal: Seal, index: KVIndex, dead_letters: DeadLetters) -> None:
    """Forever: each record applied to the index in its worker's order (one partition per worker key)."""
    while True:
        try:
            batches = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
        except KafkaError as exc:  # the broker is away: placement goes on by load and what it knew
            log.warning("cannot read KV-cache events: %r", exc)
            await asyncio.sleep(RETRY_S)
            continue
        for records in batches.values():
            for record in records:
                try:
                    _, events = seal.decode(record.topic, record.value, wire.KvEvents)
                except wire.WireError as exc:
                    await dead_letters.park(record, str(exc))
                    continue
                index.apply(events)
