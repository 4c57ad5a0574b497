"""The usage aggregate: a consumer group on the usage topic, hosted by the routers, that adds each
finished request's counts to its tenant's hourly counters in the Redis Cluster, once.

A poll's records are counted first and committed after: a router that dies in between leaves
them to the partition's next owner, whose counting finds each request already marked and adds
nothing (shared/metering/ledger.py). A record that cannot be counted (null, not sealed by a
fleet member, the wrong schema, impossible counts) is dead-lettered and committed with the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from services.router.metrics import RouterMetrics
from shared import wire
from shared.kafka_clients import DeadLetters, make_consumer
from shared.kafka_shutdown import commit_bounded, stop_client
from shared.metering.ledger import Ledger, first_of_each
from shared.metering.records import record_problem
from shared.redis_client import REDIS_UNAVAILABLE
from shared.seal import Seal
from shared.service_settings import KafkaSettings
from shared.topics import TopicLayout

log = logging.getLogger(__name__)

POLL_TIMEOUT_MS = 200
REDIS_RETRY_S = 0.5  # while the Redis Cluster fails over, counting fails: hold the batch and retry
CONCURRENCY = 32  # counting calls in flight at once, well under a node's connection pool
# After a failure no handler foresaw, a pause before starting again: doubled while it fails before
# its first poll (the broker gone, say), so an outage is not a traceback a second.
RESTART_S = 1.0
RESTART_MAX_S = 30.0


class UsageAggregator:
    def __init__(
        self, kafka: KafkaSettings, topics: TopicLayout, group: str, name: str,
        seal: Seal, ledger: Ledger, dead_letters: DeadLetters, metrics: RouterMetrics,
    ) -> None:
        self._kafka, self._topics, self._group, self._name = kafka, topics, group, name
        self._seal = seal
        self._ledger = ledger
        self._dead_letters = dead_letters
        self._metrics = metrics
        self._polled = False  # since the last start: a failure after a poll waits the shortest pause

    async def run(self, stopping: asyncio.Event) -> None:
        """Count until `stopping` is set. A failure no handler foresaw is logged, and counting
        starts again from the last commit (the ledger counts each request once): billing must
        not stop for good behind a router that goes on serving tokens."""
        pause = RESTART_S
        while not stopping.is_set():
            self._polled = False
            try:
                await self._count_polls(stopping)
            except Exception:
                self._metrics.usage_restarts.inc()
                pause = RESTART_S if self._polled else min(2 * pause, RESTART_MAX_S)
                log.exception("the usage aggregate failed; it starts again from its last commit in %.0f s", pause)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), pause)

    async def _count_polls(self, stopping: asyncio.Event) -> None:
        """Count until `stopping` is set, committing each poll once Redis has it."""
        consumer = make_consumer(self._kafka, self._topics.usage, client_id=f"{self._name}-usage", group_id=self._group)
        await consumer.start()
        try:
            while not stopping.is_set():
                batches = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
                self._polled = True
                if batches:
                    await self.take([record for part in batches.values() for record in part])
                    await self._commit(consumer, {tp: part[-1].offset + 1 for tp, part in batches.items()})
        finally:
            await stop_client(consumer)

    async def take(self, records: list[ConsumerRecord]) -> None:
        """Count the poll's records (each request once), dead-letter what cannot be counted."""
        usable: list[wire.UsageRecord] = []
        for record in records:
            try:
                _, usage = self._seal.decode(record.topic, record.value, wire.UsageRecord)
            except wire.WireError as exc:
                await self._dead_letter(record, str(exc))
                continue
            if (problem := record_problem(usage)) is not None:
                await self._dead_letter(record, problem)
                continue
            usable.append(usage)
        firsts = first_of_each(usable)
        self._metrics.usage_records.labels("duplicate").inc(len(usable) - len(firsts))
        for start in range(0, len(firsts), CONCURRENCY):
            await asyncio.gather(*(self._count(usage) for usage in firsts[start : start + CONCURRENCY]))

    async def _count(self, usage: wire.UsageRecord) -> None:
        while True:
            try:
                added = await self._ledger.count(usage)
                break
            except REDIS_UNAVAILABLE as exc:
                log.warning("usage counters unavailable (%s); retrying", exc)
                await asyncio.sleep(REDIS_RETRY_S)
        if not added:
            self._metrics.usage_records.labels("duplicate").inc()
            return
        self._metrics.usage_records.labels("counted").inc()
        tokens = self._metrics.usage_tokens
        tokens.labels("prompt").inc(usage.prompt_tokens - usage.cached_tokens)
        tokens.labels("cached").inc(usage.cached_tokens)
        tokens.labels("completion").inc(usage.completion_tokens)

    async def _commit(self, consumer: AIOKafkaConsumer, offsets: dict[TopicPartition, int]) -> None:
        # Bounded: with the broker gone a commit would wait with no end, and hold the router's stop.
        # One not made: the partitions' next owner re-reads them, and counts each request once.
        await commit_bounded(consumer, offsets)

    async def _dead_letter(self, record: ConsumerRecord, reason: str) -> None:
        self._metrics.usage_records.labels("dead_letter").inc()
        await self._dead_letters.park(record, reason)
