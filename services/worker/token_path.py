"""A worker's side of the token path: its events, sealed and sharded, onto the tokens topic.

When Kafka cannot take a batch (the broker is down, or restarting), the streams in it have a
gap that no edge can fill: they are broken, not late. The publisher says so (`on_broken`), and
the worker ends them with a retryable error sent out of band, again and again until Kafka takes
it or the edges' own progress deadline has ended them anyway. A worker never dies of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiokafka.errors import KafkaError

from services.worker.token_shards import token_batches
from shared import wire
from shared.codes import ErrorCode
from shared.producer import Producer
from shared.rate_limits import LogThrottle, Rate, held_back
from shared.seal import Seal

log = logging.getLogger(__name__)

RETELL_PERIOD_S = 1.0
LOST_LOG_RATE = Rate(per_s=0.2, burst=3)  # an outage loses every batch in flight at once
BROKEN_MESSAGE = "the token path failed (Kafka could not take this stream's tokens); retry the request"

Broken = Callable[[list[str]], None]  # request ids whose events were lost


class TokenPublisher:
    def __init__(
        self, producer: Producer, seal: Seal, topic: str, worker_id: str, shards: int, on_broken: Broken
    ) -> None:
        self._producer = producer
        self._seal = seal
        self._topic = topic
        self._worker_id = worker_id
        self._shards = shards
        self._on_broken = on_broken
        self._lost_log = LogThrottle(LOST_LOG_RATE, time.monotonic())

    async def send(self, edge_id: str, events: list[wire.Event], epochs: dict[str, int], wait: bool = False) -> bool:
        """One message per (edge, shard); see token_shards.py. False when some were lost (and reported).
        `wait`: return once Kafka has them all; every shard is queued first, so that is one round
        trip, not one per shard."""
        intact = True
        waiting: list[tuple[asyncio.Future, wire.TokenBatch]] = []
        for key, batch in token_batches(edge_id, self._worker_id, events, epochs, self._shards, time.time()):
            try:
                delivery = await self._producer.send(self._topic, self._seal.encode(self._topic, batch), key=key)
            except KafkaError as exc:
                intact = False
                self._lost(batch, exc)
                continue
            if wait:
                waiting.append((delivery, batch))
            else:
                delivery.add_done_callback(lambda done, batch=batch: self._delivered(done, batch))
        for delivery, batch in waiting:
            try:
                await delivery
            except KafkaError as exc:
                intact = False
                self._lost(batch, exc)
        return intact

    def _delivered(self, delivery: asyncio.Future, batch: wire.TokenBatch) -> None:
        if not delivery.cancelled() and delivery.exception() is not None:
            self._lost(batch, delivery.exception())

    def _lost(self, batch: wire.TokenBatch, exc: BaseException) -> None:
        request_ids = list(dict.fromkeys(event.request_id for event in batch.events))
        if (held := self._lost_log.admit(time.monotonic())) is not None:
            log.warning("a token batch for %d streams was lost: %r%s", len(request_ids), exc, held_back(held))
        self._on_broken(request_ids)

    async def tell_broken(self, edge_id: str, epochs: dict[str, int], give_up_after_s: float) -> None:
        """End these streams with a retryable error, sent until Kafka takes it or nobody waits any more."""
        errors = [wire.Error.of(rid, ErrorCode.UNAVAILABLE, BROKEN_MESSAGE) for rid in epochs]
        batches = token_batches(edge_id, self._worker_id, errors, epochs, self._shards, time.time())
        deadline = time.monotonic() + give_up_after_s
        for key, batch in batches:
            while True:
                try:
                    await self._producer.send_and_wait(self._topic, self._seal.encode(self._topic, batch), key=key)
                    break
                except KafkaError as exc:
                    if time.monotonic() >= deadline:
                        log.warning("could not tell %d broken streams their end: %r", len(batch.events), exc)
                        break
                    await asyncio.sleep(RETELL_PERIOD_S)
