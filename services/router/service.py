"""The router service: a consumer group on the token topic that puts each event on its edge.

For each poll it resolves every request's route (local cache, then the Redis
Cluster), groups the events by edge, forwards one frame per edge, and only then
commits: a router that dies mid-batch leaves the batch to the next owner of the
partition, and edges drop what they already had by seq.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiokafka import (
    AIOKafkaConsumer,
    ConsumerRebalanceListener,
    ConsumerRecord,
    TopicPartition,
)
from aiokafka.errors import KafkaError
from prometheus_client import CollectorRegistry

from services.router.edge_links import EdgeLink, EdgeUnreachable, forward_frames
from services.router.metering import UsageAggregator
from services.router.metrics import RouterMetrics
from services.router.settings import RouterSettings
from shared import wire
from shared.addresses import parse_address
from shared.fleet_membership import join_fleet
from shared.health import Health, Lifecycle
from shared.hop_timing import Hop
from shared.infra.permissions import usage_meter_group
from shared.kafka_clients import DeadLetters, make_consumer, make_producer
from shared.kafka_shutdown import COMMIT_WITHIN_S, STOP_WITHIN_S, commit_bounded, stop_client
from shared.link_auth import LinkKeys
from shared.membership import Membership
from shared.membership.member import GONE
from shared.metering.ledger import Ledger
from shared.metrics import GossipCollector, watch_consumer_lag
from shared.producer import Producer
from shared.redis_client import REDIS_UNAVAILABLE, discover, make_cluster
from shared.routing_map import Route, RoutingMap
from shared.seal import Seal
from shared.status_server import status_endpoint

log = logging.getLogger(__name__)
T = TypeVar("T")

POLL_TIMEOUT_MS = 100
ROUTE_RETRY_S = 0.5  # while the Redis Cluster fails over, lookups fail; wait and retry
COMMIT_PERIOD_S = 0.1
# The usage aggregate's poll in hand, counted and committed, and its consumer stopped: each
# bounded (kafka_shutdown.py), even with the broker gone.
USAGE_STOP_S = COMMIT_WITHIN_S + STOP_WITHIN_S + 1.0
CANCEL_WAIT_S = 1.0


class _ServingOnAssignment(ConsumerRebalanceListener):
    """Serving once the group has given this router its share of the token partitions."""

    def __init__(self, name: str, health: Health) -> None:
        self._name = name
        self._health = health

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        pass

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        if self._health.state is Lifecycle.STARTING:
            log.info("router %s serving", self._name)
        self._health.set(Lifecycle.SERVING)


class RouterService:
    def __init__(self, settings: RouterSettings, health: Health | None = None) -> None:
        self.settings = settings
        self.health = health or Health("router", settings.name)
        self.topics = settings.topics
        self._static = settings.edge_addresses()
        self._links: dict[str, EdgeLink] = {}
        self._seal = Seal(settings.fleet_secret, settings.name)
        self._link_keys = LinkKeys(settings.fleet_secret)
        self._membership: Membership | None = None
        self._routes: RoutingMap | None = None
        self._producer: Producer | None = None
        self._dead_letters: DeadLetters | None = None
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)
        self._forwarded: dict[TopicPartition, int] = {}  # next offset per partition, forwarded and not yet committed

    async def run(self, stopping: asyncio.Event | None = None) -> None:
        """Forward until `stopping` is set; then finish the batch in hand, commit, and leave the
        group and gossip (a router holds no stream of its own to drain)."""
        stopping = stopping or asyncio.Event()
        name = self.settings.name
        redis = make_cluster(self.settings.redis)
        self._routes = RoutingMap(redis, self.settings.route_cache_size)
        kafka = self.settings.kafka
        self._producer = make_producer(kafka, client_id=name)
        self._dead_letters = DeadLetters(self._producer, self.topics.dead_letter, name)
        consumer = make_consumer(kafka, client_id=name, group_id=f"{self.topics.prefix}-routers")
        consumer.subscribe([self.topics.tokens], listener=_ServingOnAssignment(name, self.health))
        await self._producer.start()
        await discover(redis)
        self._membership = await join_fleet(self.settings, name, "router", {}, {})
        self.registry.register(GossipCollector(self._membership))
        await consumer.start()
        lag = watch_consumer_lag(consumer, self.registry)
        committer = asyncio.create_task(self._commit_forwarded(consumer))
        # The usage aggregate runs beside the token path, in a consumer group of its own.
        usage = UsageAggregator(
            kafka, self.topics, usage_meter_group(self.topics), name, self._seal, Ledger(redis), self._dead_letters, self.metrics
        )
        metering = asyncio.create_task(usage.run(stopping))
        metrics = self.settings.metrics
        try:
            async with status_endpoint(self.registry, self.health, metrics.host, metrics.port):
                while not stopping.is_set():
                    batches = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
                    polled = time.time()
                    records = [record for part in batches.values() for record in part]
                    if records:
                        await self._route(records, polled)
                        for tp, part in batches.items():
                            self._forwarded[tp] = part[-1].offset + 1
        finally:
            self.health.set(Lifecycle.STOPPED)
            committer.cancel()
            lag.cancel()
            # Side by side: with the broker gone each part waits out its bounds, and one after
            # another those would add up past the stop backstop (a lost broker test saw it).
            await asyncio.gather(self._leave_group(consumer), self._stop_metering(metering))
            for link in self._links.values():
                await link.close()
            await self._membership.stop()
            await redis.aclose()

    async def _leave_group(self, consumer: AIOKafkaConsumer) -> None:
        await commit_bounded(consumer, self._forwarded)
        await stop_client(consumer)

    async def _stop_metering(self, metering: asyncio.Task) -> None:
        """The usage aggregate ends its poll in hand (counted, committed) and stops its consumer,
        then the producer it dead-letters through stops; past USAGE_STOP_S it is cancelled."""
        done, _ = await asyncio.wait({metering}, timeout=USAGE_STOP_S)
        if not done:
            log.warning("the usage aggregate did not stop within %.0f s; cancelling it", USAGE_STOP_S)
            metering.cancel()
            await asyncio.wait({metering}, timeout=CANCEL_WAIT_S)
        await stop_client(self._producer)

    async def _commit_forwarded(self, consumer: AIOKafkaConsumer) -> None:
        """Commit what was forwarded, off the hot path: a commit is a broker round trip, and
        waiting for it before the next poll would delay every token behind it."""
        while True:
            await asyncio.sleep(COMMIT_PERIOD_S)
            if self._forwarded:
                offsets, self._forwarded = self._forwarded, {}
                try:
                    await consumer.commit(offsets)
                except KafkaError as exc:  # e.g. a rebalance took the partitions: their new owner re-reads
                    log.warning("commit failed: %r", exc)

    async def _route(self, records: list[ConsumerRecord], polled: float) -> None:
        """`polled`: when the consumer handed these records over (unix seconds), for the hop timings."""
        events: list[tuple[str, wire.Event]] = []  # (the worker that sealed it, the event)
        per_edge: dict[str, list[wire.Delivery]] = defaultdict(list)
        min_epochs: dict[str, int] = {}
        for record in records:
            try:
                worker_id, batch = self._seal.decode(record.topic, record.value, wire.TokenBatch)
            except wire.WireError as exc:
                await self._dead_letter(record, str(exc))
                continue
            if batch.sent_at:
                self.metrics.hops.observe(Hop.TOKEN_KAFKA, polled - batch.sent_at)
            for event in batch.events:
                if isinstance(event, wire.Moved):  # addressed to the connection it names
                    if self._link(batch.edge_id) is not None:
                        per_edge[batch.edge_id].append(wire.Delivery(event.conn_id, event, worker_id))
                else:
                    events.append((worker_id, event))
            min_epochs.update(batch.epochs)
        lookup = self._lookup([event.request_id for _, event in events], min_epochs)
        if starts := [e for _, e in events if isinstance(e, wire.Started)]:
            # Two round trips at once: both must be done before anything is forwarded, not one after the other.
            routes, _ = await asyncio.gather(lookup, self._record_claims(starts))
        else:
            routes = await lookup
        for worker_id, event in events:
            route = routes.get(event.request_id)
            if route is None or self._link(route.edge_id) is None:
                self.metrics.unroutable.inc()
                continue
            per_edge[route.edge_id].append(wire.Delivery(route.conn_id, event, worker_id))
        self.metrics.events.inc(len(events))
        self.metrics.forwards.inc(len(per_edge))
        sends = [self._forward(edge_id, deliveries) for edge_id, deliveries in per_edge.items()]
        if len(sends) == 1:
            await sends[0]  # the common case needs no task of its own (and no turn of the loop to start it)
        else:
            await asyncio.gather(*sends)
        routed_s = time.time() - polled
        for _ in records:  # weighted like the token_kafka hop: per record
            self.metrics.hops.observe(Hop.ROUTE, routed_s)

    async def _lookup(self, request_ids: list[str], min_epochs: dict[str, int]) -> dict[str, Route]:
        hits, misses = self._routes.num_cache_hits, self._routes.num_cache_misses
        routes = await self._retry_redis(lambda: self._routes.get_many(request_ids, min_epochs))
        self.metrics.cache_hits.inc(self._routes.num_cache_hits - hits)
        self.metrics.cache_misses.inc(self._routes.num_cache_misses - misses)
        return routes

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
            except REDIS_UNAVAILABLE as exc:
                log.warning("routing map unavailable (%s); retrying", exc)
                await asyncio.sleep(ROUTE_RETRY_S)

    def _link(self, edge_id: str) -> EdgeLink | None:
        """The link to an edge at the address membership gives (or the static list, if any)."""
        member = self._membership.member(edge_id) if self._membership else None
        if member is not None and "internal" in member.addresses:
            address = parse_address(member.addresses["internal"])
        elif edge_id in self._static:
            address = self._static[edge_id]
        else:
            return None  # never heard of: nowhere to send
        link = self._links.get(edge_id)
        if link is None or link.address != address:
            link = self._links[edge_id] = EdgeLink(edge_id, address, self._link_keys, self.settings.name)
        return link

    async def _forward(self, edge_id: str, deliveries: list[wire.Delivery]) -> None:
        # An edge declared dead gets one try, not the patient retries: if it really is gone,
        # the batch must not wait on it; if gossip was wrong (an overloaded edge answers
        # late), its clients still get their tokens.
        member = self._membership.member(edge_id) if self._membership else None
        attempts = 1 if member is not None and member.status in GONE else None
        try:
            for frame in forward_frames(deliveries, sent_at=time.time()):
                await self._links[edge_id].send(frame, attempts)
        except EdgeUnreachable as exc:
            # Its clients' sockets died with it; nothing is left to deliver to.
            self.metrics.unroutable.inc(len(deliveries))
            log.warning("%s; dropped %d events", exc, len(deliveries))

    async def _dead_letter(self, record: ConsumerRecord, reason: str) -> None:
        self.metrics.dead_letters.inc()
        await self._dead_letters.park(record, reason)

