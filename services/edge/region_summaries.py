"""Capacity summaries between regions: each edge publishes its region's load on one global topic
and reads its peers' (no consumer group, from the latest offset), so placement knows who has room.

The topic is shared by every region, so its records are input like any other: one that is
not a sealed `RegionCapacity` of this wire version (garbage, null, a bad seal) is skipped
and counted, never a crash. Freshness is judged by when a record arrived here, not by the
sender's clock, so clocks that differ between regions do not matter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import msgspec
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from prometheus_client import Counter

from services.edge.region_choice import PeerRoom
from services.edge.region_settings import RegionName, RegionSettings
from shared import wire
from shared.kafka_clients import make_consumer
from shared.kafka_shutdown import stop_client
from shared.producer import Producer
from shared.rate_limits import LogThrottle, Rate, held_back
from shared.seal import Seal
from shared.service_settings import KafkaSettings

log = logging.getLogger(__name__)

STALE_INTERVALS = 3  # a peer's summary older than this many intervals counts as no room
POLL_TIMEOUT_MS = 200
RETRY_S = 1.0
SKIPPED_LOG_RATE = Rate(per_s=0.2, burst=5)
Load = Annotated[float, msgspec.Meta(ge=0.0, le=1000.0)]


class RegionCapacity(msgspec.Struct, frozen=True, tag="region-capacity"):
    """One edge -> every region: its region's fleet load now; `load` None while it knows no worker."""

    region: RegionName
    load: Load | None
    overflow_load: Load  # the load from which the sender's region takes no more chats
    at: float  # unix seconds at the sender, for people reading the topic
    v: int = wire.WIRE_VERSION


@dataclass(frozen=True)
class Held:
    capacity: RegionCapacity
    received_at: float  # this edge's monotonic clock


class PeerSummaries:
    """Each peer region's newest summary (the last one read: the topic has one partition, in order)."""

    def __init__(self, settings: RegionSettings, seal: Seal, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._seal = seal
        self._clock = clock
        self._peers = {peer.name: peer for peer in settings.peers}
        self._held: dict[str, Held] = {}

    def apply(self, data: object) -> RegionCapacity | None:
        """Read one record; raises WireError for one that is not a sealed summary. None: not about a peer."""
        _, capacity = self._seal.decode(self._settings.summary_topic, data, RegionCapacity)
        assert isinstance(capacity, RegionCapacity)
        if capacity.region not in self._peers:
            return None  # this region's own edges, or a region this one does not send to
        self._held[capacity.region] = Held(capacity, self._clock())
        return capacity

    def load_of(self, region: str) -> float | None:
        """The region's load from a fresh summary, or None (none, stale, or it knows no worker)."""
        held = self._held.get(region)
        if held is None or self._clock() - held.received_at > STALE_INTERVALS * self._settings.summary_interval_s:
            return None
        return held.capacity.load

    def rooms(self) -> list[PeerRoom]:
        """Every configured peer as placement sees it now."""
        rooms = []
        for name, peer in self._peers.items():
            held = self._held.get(name)
            overflow = held.capacity.overflow_load if held is not None else 0.0
            rooms.append(PeerRoom(name, peer.rtt_ms, self.load_of(name), overflow))
        return rooms


class RegionSummaries:
    """The I/O around PeerSummaries: publishes this region's load every interval and reads the topic.

    `start` and `stop` own the consumer and both tasks; a broker that is away is logged and
    retried, and placement meanwhile sees its peers' summaries go stale (no room).
    """

    def __init__(
        self,
        settings: RegionSettings,
        kafka: KafkaSettings,
        client_id: str,
        producer: Producer,
        seal: Seal,
        book: PeerSummaries,
        load: Callable[[], float | None],
        skipped: Counter,
    ) -> None:
        self._settings = settings
        self._producer = producer
        self._seal = seal
        self._book = book
        self._load = load
        self._skipped = skipped
        self._kafka = kafka
        self._client_id = client_id
        self._consumer: AIOKafkaConsumer | None = None
        self._tasks: list[asyncio.Task] = []
        self._log = LogThrottle(SKIPPED_LOG_RATE, time.monotonic())

    async def start(self) -> None:
        topic, client_id = self._settings.summary_topic, self._client_id
        # Every edge reads every region's summaries: no group, from now on.
        self._consumer = make_consumer(self._kafka, topic, client_id=client_id, group_id=None, auto_offset_reset="latest")
        await self._consumer.start()
        self._tasks = [asyncio.create_task(self._publish_forever()), asyncio.create_task(self._read_forever(self._consumer))]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._consumer is not None:
            await stop_client(self._consumer)

    def summary(self) -> RegionCapacity:
        return RegionCapacity(self._settings.name, self._load(), self._settings.overflow_load, time.time())

    async def _publish_forever(self) -> None:
        topic = self._settings.summary_topic
        while True:
            try:
                await self._producer.send(topic, self._seal.encode(topic, self.summary()))
            except KafkaError as exc:
                log.warning("cannot publish this region's capacity: %r", exc)
            await asyncio.sleep(self._settings.summary_interval_s)

    async def _read_forever(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
            except KafkaError as exc:
                log.warning("cannot read region capacity summaries: %r", exc)
                await asyncio.sleep(RETRY_S)
                continue
            for records in batches.values():
                for record in records:
                    self.read(record.value, record.offset)

    def read(self, value: object, offset: int = -1) -> None:
        """One record into the book; a bad one is counted and logged (throttled), and skipped."""
        try:
            self._book.apply(value)
        except wire.WireError as exc:
            self._skipped.inc()
            if (held := self._log.admit(time.monotonic())) is not None:
                log.warning("skipped a record at offset %d of %s: %s%s", offset, self._settings.summary_topic, exc, held_back(held))
