"""The router service: a consumer group on the token topic that puts each event on its edge.

For each poll it resolves every request's route (local cache, then the Redis
Cluster), groups the events by edge, forwards one frame per edge, and only then
commits: a router that dies mid-batch leaves the batch to the next owner of the
partition, and edges drop what they already had by seq.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiokafka import AIOKafkaProducer, ConsumerRecord
from redis.exceptions import RedisError

from services.router.config import RouterConfig
from services.router.edge_links import EdgeLink, EdgeUnreachable
from shared import wire
from shared.kafka_clients import make_consumer, make_producer, send_dead_letter
from shared.redis_client import make_cluster
from shared.routing_map import Route, RoutingMap

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_TIMEOUT_MS = 100
ROUTE_RETRY_S = 0.5  # while the Redis Cluster fails over, lookups fail; wait and retry


class RouterService:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.topics = config.topics
        self._links = {edge_id: EdgeLink(edge_id, addr) for edge_id, addr in config.edge_addresses().items()}
        self._routes: RoutingMap | None = None
        self._producer: AIOKafkaProducer | None = None
        self.num_unroutable = 0
        self.num_dead_letters = 0

    async def run(self, ready: asyncio.Event | None = None) -> None:
        name = self.config.name
        redis = make_cluster(self.config.redis_startup_nodes())
        self._routes = RoutingMap(redis, self.config.route_cache_size)
        self._producer = make_producer(self.config.kafka_bootstrap, client_id=name)
        consumer = make_consumer(
            self.config.kafka_bootstrap, self.topics.tokens, client_id=name, group_id=f"{self.topics.prefix}-routers"
        )
        await self._producer.start()
        await consumer.start()
        log.info("router %s ready", name)
        if ready is not None:
            ready.set()
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
                records = [record for part in batches.values() for record in part]
                if records:
                    await self._route(records)
                    await consumer.commit()
        finally:
            with contextlib.suppress(Exception):
                await consumer.stop()
            await self._producer.stop()
            for link in self._links.values():
                await link.close()
            await redis.aclose()

    async def _route(self, records: list[ConsumerRecord]) -> None:
        events: list[wire.Event] = []
        min_epochs: dict[str, int] = {}
        for record in records:
            try:
                batch = wire.decode(record.value, wire.TokenBatch)
            except wire.WireError as exc:
                await self._dead_letter(record, str(exc))
                continue
            events.extend(batch.events)
            min_epochs.update(batch.epochs)
        await self._record_claims([e for e in events if isinstance(e, wire.Started)])
        routes = await self._lookup([event.request_id for event in events], min_epochs)
        per_edge: dict[str, list[wire.Delivery]] = defaultdict(list)
        for event in events:
            route = routes.get(event.request_id)
            if route is None or route.edge_id not in self._links:
                self.num_unroutable += 1
                continue
            per_edge[route.edge_id].append(wire.Delivery(route.conn_id, event))
        sends = [self._forward(edge_id, deliveries) for edge_id, deliveries in per_edge.items()]
        await asyncio.gather(*sends)

    async def _lookup(self, request_ids: list[str], min_epochs: dict[str, int]) -> dict[str, Route]:
        return await self._retry_redis(lambda: self._routes.get_many(request_ids, min_epochs))

    async def _record_claims(self, starts: list[wire.Started]) -> None:
        """Who started what goes into the routing map, where a worker that is handed the
        same request again (its first owner died) finds it and does not run it twice."""
        if starts:
            owners = {start.request_id: start.worker_id for start in starts}
            await self._retry_redis(lambda: self._routes.claim(owners))

    async def _retry_redis(self, call: Callable[[], Awaitable[T]]) -> T:
        """While the Redis Cluster fails over, calls fail: hold the batch and retry."""
        while True:
            try:
                return await call()
            except (RedisError, OSError) as exc:
                log.warning("routing map unavailable (%s); retrying", exc)
                await asyncio.sleep(ROUTE_RETRY_S)

    async def _forward(self, edge_id: str, deliveries: list[wire.Delivery]) -> None:
        try:
            await self._links[edge_id].send(wire.encode(wire.ForwardBatch(deliveries)))
        except EdgeUnreachable as exc:
            # Its clients' sockets died with it; nothing is left to deliver to.
            self.num_unroutable += len(deliveries)
            log.warning("%s; dropped %d events", exc, len(deliveries))

    async def _dead_letter(self, record: ConsumerRecord, reason: str) -> None:
        self.num_dead_letters += 1
        await send_dead_letter(self._producer, self.topics.dead_letter, record, self.config.name, reason)
