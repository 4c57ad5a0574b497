"""KV-cache events: what enters and leaves the engine's prefix cache, published for edges to place by.

The block pool tells a `KVEventCollector` on the engine's thread (a dict write under a lock);
`publish_kv_events` drains it on the event loop every interval into sealed `KvEvents` records
on the kv-events topic, keyed by worker. Within one interval only a block's last state counts:
a block stored and evicted again is sent as evicted, evicted and stored again as stored. The
events are hints for placement: a record lost, or a backlog dropped, costs cache hits, never a
wrong answer (the engine re-checks every hit against its tokens).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

from aiokafka.errors import KafkaError

from shared import wire
from shared.models.block_hash import block_key
from shared.producer import Producer
from shared.seal import Seal

log = logging.getLogger(__name__)

MAX_PENDING = 200_000  # blocks noted between two drains; past this the oldest news is dropped
MAX_KEYS_PER_RECORD = 20_000  # ~9 bytes each: a record stays far under the topics' record size


@dataclass
class KVEventBatch:
    stored: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    cleared: bool = False


class KVEventCollector:
    """The block pool's listener (engine thread); `drain` takes what was noted (any thread)."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, bool] = {}  # block key -> stored (True) or evicted (False), last state
        self._cleared = False
        self._max_pending = max_pending
        self.num_dropped = 0

    def block_stored(self, value: bytes) -> None:
        self._note(block_key(value), True)

    def block_evicted(self, value: bytes) -> None:
        self._note(block_key(value), False)

    def cache_cleared(self) -> None:
        with self._lock:
            self._pending.clear()
            self._cleared = True

    def drain(self) -> KVEventBatch | None:
        """Everything noted since the last drain, or None if nothing was."""
        with self._lock:
            pending, cleared = self._pending, self._cleared
            self._pending, self._cleared = {}, False
        if not pending and not cleared:
            return None
        batch = KVEventBatch(cleared=cleared)
        for key, stored in pending.items():
            (batch.stored if stored else batch.evicted).append(key)
        return batch

    def _note(self, key: int, stored: bool) -> None:
        with self._lock:
            self._pending.pop(key, None)  # re-inserted last: the dict's order is the order of news
            self._pending[key] = stored
            if len(self._pending) > self._max_pending:
                del self._pending[next(iter(self._pending))]
                self.num_dropped += 1


def kv_records(worker_id: str, block_size: int, batch: KVEventBatch) -> list[wire.KvEvents]:
    """One batch as records of at most MAX_KEYS_PER_RECORD keys, `cleared` on the first."""
    records: list[wire.KvEvents] = []
    evicted, stored = batch.evicted, batch.stored
    cleared = batch.cleared
    while cleared or evicted or stored:
        take_evicted = evicted[:MAX_KEYS_PER_RECORD]
        take_stored = stored[: MAX_KEYS_PER_RECORD - len(take_evicted)]
        evicted, stored = evicted[len(take_evicted) :], stored[len(take_stored) :]
        records.append(wire.KvEvents(worker_id, block_size, take_stored, take_evicted, cleared))
        cleared = False
    return records


async def publish_kv_events(
    collector: KVEventCollector, producer: Producer, seal: Seal, topic: str, block_size: int, interval_s: float
) -> None:
    """Forever: every `interval_s`, what the collector holds, sealed, to the kv-events topic."""
    worker_id = seal.sender
    while True:
        await asyncio.sleep(interval_s)
        batch = collector.drain()
        if batch is None:
            continue
        for record in kv_records(worker_id, block_size, batch):
            try:
                await producer.send(topic, seal.encode(topic, record), key=worker_id.encode())
            except KafkaError as exc:  # the broker is away: edges place by load until news comes again
                log.warning("could not publish KV-cache events: %r", exc)
