"""Reads a topic from 'now' on, so a test can see what the services put on the wire."""

from __future__ import annotations

import time
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, TopicPartition

from shared import wire
from shared.infra import kafka_bootstrap


class KafkaTap:
    def __init__(self, infra, topic: str, partitions: int) -> None:
        self._topic = topic
        self._partitions = partitions
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=kafka_bootstrap(infra), group_id=None, enable_auto_commit=False, fetch_max_wait_ms=20
        )

    async def __aenter__(self) -> KafkaTap:
        await self._consumer.start()
        tps = [TopicPartition(self._topic, p) for p in range(self._partitions)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_end(*tps)
        for tp in tps:
            await self._consumer.position(tp)  # resolve 'end' now, before the test acts
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._consumer.stop()

    async def records(self, timeout: float) -> list[bytes]:
        batches = await self._consumer.getmany(timeout_ms=int(timeout * 1000))
        return [r.value for part in batches.values() for r in part]

    async def events_until(self, done: Callable[[wire.Event], bool], timeout: float) -> list[wire.Event]:
        """Token-path events seen until one satisfies `done` (TimeoutError if none does in time)."""
        events: list[wire.Event] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for value in await self.records(0.2):
                for event in wire.decode(value, wire.TokenBatch).events:
                    events.append(event)
                    if done(event):
                        return events
        raise TimeoutError(f"no matching event on {self._topic} in {timeout} s")
