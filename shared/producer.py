"""A Kafka producer that outlives a broker outage.

aiokafka's idempotent producer gives up for good once a batch has expired unsent (a broker
away longer than the request timeout): the batch's sequence numbers leave a gap, the broker
answers the next batch with OutOfOrderSequenceNumber, and the producer's sender stops. This
one then starts a fresh producer (a new producer id, so sequences begin again) on the next
send, and goes on; what was lost is the caller's to handle, as with any failed send.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, OutOfOrderSequenceNumber, ProducerFenced

from shared.kafka_shutdown import stop_client

log = logging.getLogger(__name__)

FATAL = (OutOfOrderSequenceNumber, ProducerFenced)  # after these, aiokafka's producer sends nothing more


class Producer:
    def __init__(self, make: Callable[[], AIOKafkaProducer]) -> None:
        self._make = make
        self._inner = make()
        self._broken = False
        self._replacing = asyncio.Lock()
        self.num_replacements = 0

    async def start(self) -> None:
        await self._inner.start()

    async def stop(self) -> None:
        await stop_client(self._inner)

    async def flush(self) -> None:
        await self._inner.flush()

    async def send(
        self, topic: str, value: bytes | None, key: bytes | None = None, partition: int | None = None
    ) -> asyncio.Future:
        """Queue a record (to `partition`, else the key's); the future is its delivery. Raises KafkaError
        when it cannot even be queued."""
        if self._broken:
            await self._replace()
        try:
            delivery = await self._inner.send(topic, value, key=key, partition=partition)
        except FATAL:
            self._broken = True
            raise
        delivery.add_done_callback(self._check)
        return delivery

    async def send_and_wait(
        self, topic: str, value: bytes | None, key: bytes | None = None, partition: int | None = None
    ) -> object:
        return await (await self.send(topic, value, key, partition))

    def _check(self, delivery: asyncio.Future) -> None:
        if not delivery.cancelled() and isinstance(delivery.exception(), FATAL):
            self._broken = True

    async def _replace(self) -> None:
        async with self._replacing:
            if not self._broken:
                return  # another send replaced it meanwhile
            fresh = self._make()
            try:
                await fresh.start()
            except KafkaError:
                await stop_client(fresh)
                raise
            old, self._inner, self._broken = self._inner, fresh, False
            self.num_replacements += 1
            log.warning("the Kafka producer had stopped for good (a batch expired unsent); started a fresh one")
            await stop_client(old)
