"""The edge service: admits chats from sockets to Kafka and puts routed tokens back on them.

A chat is checked here (frame, prompt length) before anything is written anywhere;
then its route goes to the Redis Cluster, `accepted` to the client, and the request
to Kafka. Tokens come back from routers over the internal link. When a socket drops,
its streams wait a grace period for the client to resume them (on any edge) before
the workers are told to cancel them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections import defaultdict
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import KafkaError
from prometheus_client import CollectorRegistry
from redis.asyncio.cluster import RedisCluster

from services.edge.connection import Connection
from services.edge.deadlines import Deadlines, overdue
from services.edge.kv_index import KVIndex
from services.edge.metering import EdgeMeter
from services.edge.metrics import EdgeMetrics
from services.edge.placer import Placer
from services.edge.protocol import (
    AcceptedFrame,
    CancelFrame,
    ChatFrame,
    ProtocolError,
    ResumedFrame,
    ResumeFrame,
    parse_client_frame,
)
from services.edge.region_overflow import RegionOverflow
from services.edge.response_store import ResponseStore
from services.edge.router_link import RefusalLog, RouterLinkServer
from services.edge.settings import EdgeSettings
from services.edge.structured_request import (
    parses_tool_calls,
    structured_fields,
    wire_messages,
)
from services.edge.tenancy import FleetLoad, NoFleet, TenantGate
from services.edge.tenant_directory import TenantDirectory
from shared import wire
from shared.codes import ErrorCode
from shared.health import Health
from shared.hop_timing import SOCKET_WRITE_SAMPLE, EveryNth, Hop
from shared.link_auth import LinkKeys
from shared.metering.publisher import UsagePublisher
from shared.metering.records import UsageContext
from shared.models.prompt_length import PromptLimit, PromptTokens
from shared.models.structured import InvalidGrammar
from shared.producer import Producer
from shared.redis_client import REDIS_UNAVAILABLE
from shared.routing_map import Route, RoutingMap
from shared.seal import Seal

log = logging.getLogger(__name__)

REFUSED_RESUME = "no resumable stream matches this request id and token"
TENANTS_RELOAD_S = 1.0  # how often the tenants file is looked at: a revoked key's sockets close within about this
POLICY_VIOLATION = 1008
DRAINING = "this edge is stopping; reconnect (to another edge) and retry"
WORKER_LEFT_GRACE_S = 2.0  # a worker that left in good order sent its streams' endings first: let them arrive
DRAIN_POLL_S = 0.1
# Kafka failed a record, or did not take it within admit_timeout_s (asyncio's TimeoutError).
KAFKA_DOWN = (KafkaError, TimeoutError)


@dataclass(frozen=True)
class EdgeLoad:
    connections: int
    chats: int


class EdgeService:
    def __init__(
        self,
        settings: EdgeSettings,
        producer: Producer,
        redis: RedisCluster,
        prompt_limit: PromptLimit,
        registry: CollectorRegistry | None = None,
        health: Health | None = None,
        fleet_load: FleetLoad = NoFleet(),
        prompt_tokens: PromptTokens | None = None,
    ) -> None:
        self.settings = settings
        self.health = health or Health("edge", settings.edge_id)
        self.registry = registry or CollectorRegistry()
        self.metrics = EdgeMetrics(self.registry)
        self.metrics.connections.set_function(lambda: len(self._connections))
        self.metrics.chats_in_flight.set_function(lambda: self.load().chats)
        self.tenants = TenantDirectory(settings.tenants_file, settings.api_keys, settings.tenant_tiers)
        self.topics = settings.topics
        self._producer = producer
        self._seal = Seal(settings.fleet_secret, settings.edge_id)
        self._refused_event = RefusalLog(self.metrics.link_refusals)
        self.router_links = RouterLinkServer(
            LinkKeys(settings.fleet_secret), settings.edge_id, self.deliver, self._refused_event, self.metrics.hops
        )
        self._routes = RoutingMap(redis)
        self._prompt_limit = prompt_limit
        usage = UsagePublisher(producer, self._seal, self.topics.usage, self.metrics.usage_records)
        self.meter = EdgeMeter(usage, settings.edge_id)  # metering.py: usage of streams whose worker died
        # Tenancy: admission by tier against the fleet's load, and each tenant's limits and slots.
        self.tenancy = TenantGate(settings.tenancy, redis, self.tenants, fleet_load)
        self.responses = ResponseStore(redis, settings.responses_ttl_s)  # /v1/responses' previous_response_id
        # Placement: the worker (a requests partition it owns) each chat goes to (placer.py).
        placement = settings.placement
        index = KVIndex(placement.index_blocks_per_worker)
        self.placer = Placer(
            placement.policy, placement.load_bound, settings.engine, prompt_tokens, index, placement.conversations
        )
        self._deadlines = Deadlines(settings.progress_timeout_s, settings.start_timeout_s)
        # Regions: a chat this region is too full for is relayed to a peer region (region_overflow.py).
        self.regions = RegionOverflow(settings.regions, self._seal, fleet_load, self.registry)
        self._connections: dict[str, Connection] = {}
        self._socket_writes = EveryNth(self.metrics.hops, Hop.SOCKET_WRITE, SOCKET_WRITE_SAMPLE)  # every connection's
        self._detached: dict[str, tuple[float, int]] = {}  # request id -> (cancel at, epoch)
        self._background: set[asyncio.Task] = set()
        self.draining = False

    # Client side ---------------------------------------------------------------------
    def open_connection(self, conn: Connection) -> None:
        self._connections[conn.conn_id] = conn
        conn.on_written = self._socket_writes

    async def close_connection(self, conn: Connection, grace: bool = True) -> None:
        """The client is gone; its unfinished streams are cancelled, after a grace period to resume."""
        self._connections.pop(conn.conn_id, None)
        self.regions.close_connection(conn.conn_id)  # relayed chats cannot be resumed: cancelled at once
        await self.tenancy.end_socket(conn.conn_id)
        if not grace:
            try:
                await self._cancel_by_epoch({chat.request_id: chat.epoch for chat in conn.chats()})
            except KAFKA_DOWN as exc:  # its worker runs on to the end, with nobody to send to
                log.warning("could not cancel the chats of %s: %r", conn.conn_id, exc)
            for chat in conn.chats():
                await self.tenancy.end_stream(chat.request_id)
            return
        cancel_at = time.monotonic() + self.settings.resume_grace_s
        for chat in conn.chats():
            self._detached[chat.request_id] = (cancel_at, chat.epoch)

    async def handle_frame(self, conn: Connection, text: str | bytes) -> None:
        try:
            frame = parse_client_frame(text)
            if isinstance(frame, ChatFrame):
                await self.start_chat(conn, frame)
            elif isinstance(frame, CancelFrame):
                await self.cancel_chat(conn, frame.id)
            elif isinstance(frame, ResumeFrame):
                await self.resume_chat(conn, frame)
        except ProtocolError as exc:
            self.count_refusal(exc.code, conn.tenant)
            conn.send(exc.frame())

    def tier_of(self, tenant: str) -> str:
        return self.tenants.tier_of(tenant)

    async def watch_tenants(self, period_s: float = TENANTS_RELOAD_S) -> None:
        """Re-read the tenants file when it changes; close the sockets of keys it no longer holds."""
        while True:
            await asyncio.sleep(period_s)
            if self.tenants.reload_if_changed():
                await self.close_revoked()

    async def close_revoked(self) -> None:
        revoked = [c for c in self._connections.values() if c.key_hash and not self.tenants.holds(c.tenant, c.key_hash)]
        for conn in revoked:
            log.info("closing a socket of tenant %s: its API key was revoked", conn.tenant)
        await asyncio.gather(*(conn.shut(POLICY_VIOLATION, "API key revoked") for conn in revoked))

    def count_refusal(self, code: ErrorCode | str, tenant: str | None) -> None:
        """Every refusal, from any endpoint; one without a known key has no tier."""
        self.metrics.refusals.labels(code, self.tier_of(tenant) if tenant else "none").inc()

    def _check_new_chat(self, conn: Connection, chat_id: str) -> None:
        if self.draining:
            raise ProtocolError(ErrorCode.EDGE_DRAINING, DRAINING, chat_id)
        if conn.has_chat(chat_id) or self.regions.has_chat(conn.conn_id, chat_id):
            raise ProtocolError(ErrorCode.DUPLICATE_ID, f"chat id {chat_id!r} is already in flight on this socket", chat_id)
        if conn.num_chats() + self.regions.num_chats(conn.conn_id) >= self.settings.max_chats_per_connection:
            limit = self.settings.max_chats_per_connection
            raise ProtocolError(ErrorCode.TOO_MANY_CHATS, f"at most {limit} chats in flight per socket", chat_id)

    async def start_chat(self, conn: Connection, frame: ChatFrame) -> None:
        """Admit a chat for any kind of connection; raises ProtocolError when refused.

        Every check that can refuse the request itself comes before anything is written, so
        `unavailable` (retryable) only ever means Redis or Kafka failed; a route already
        written for a chat that then fails is removed again.
        """
        received = time.perf_counter()
        self._check_new_chat(conn, frame.id)
        try:
            structured = structured_fields(frame)  # a grammar that cannot compile never reaches a worker
        except InvalidGrammar as exc:
            raise ProtocolError(ErrorCode.INVALID_SCHEMA, str(exc), frame.id) from exc
        prompt_tokens, reason = self._prompt_limit.measure(frame.prompt_input(), structured["tools"])  # listing too
        if reason is not None:
            raise ProtocolError(ErrorCode.PROMPT_TOO_LONG, reason, frame.id)
        # The default stays valid on a model whose context is shorter: the worker stops at the context.
        if frame.max_tokens > max(self._prompt_limit.context, wire.DEFAULT_MAX_TOKENS):
            reason = f"max_tokens {frame.max_tokens} is more than the model's context of {self._prompt_limit.context}"
            raise ProtocolError(ErrorCode.INVALID_MESSAGE, reason, frame.id)
        if await self.regions.place(conn, frame):
            return  # relayed to a peer region, which admits and serves it
        request_id, resume_token = uuid.uuid4().hex, secrets.token_urlsafe(24)
        # The tenant's tier against the fleet's load, then its limits; from here on it holds a stream slot.
        await self.tenancy.admit_chat(conn.tenant, frame.id, request_id, prompt_tokens, frame.max_tokens)
        request = wire.ChatRequest(
            request_id=request_id,
            edge_id=self.settings.edge_id,
            conn_id=conn.conn_id,
            tenant=conn.tenant,
            messages=wire_messages(frame.messages),
            max_tokens=frame.max_tokens,
            temperature=frame.temperature,
            top_p=frame.top_p,
            seed=frame.seed,
            created_at=time.time(),
            weight=self.tenants.tier(conn.tenant).weight,
            priority=frame.priority,
            controls=frame.controls(),
            tier=self.tier_of(conn.tenant),
            prompt_tokens=prompt_tokens,
            **structured,
            prompt=frame.prompt,  # a raw prompt (a completion's): fed to the model without the chat template
        )
        payload = self._seal.encode(self.topics.requests, request)  # the frame's ranges are the wire's, so this cannot fail
        conn.open_chat(frame.id, request_id, reads_tools=parses_tool_calls(frame))  # done carries the calls
        self.meter.admitted(request_id, UsageContext.of(request))
        routed = False
        try:
            await self._routes.put(request_id, Route(self.settings.edge_id, conn.conn_id), conn.tenant, resume_token)
            routed = True
            # Accepted goes out before the request can reach a worker, so it precedes every token.
            conn.send(AcceptedFrame(frame.id, request_id, resume_token))
            placed = self.placer.place(request_id, conn.tenant, frame.prompt_input(), frame.conversation)
            partition = placed[1] if placed else None  # None: the key's default partition
            try:
                async with asyncio.timeout(self.settings.admit_timeout_s):  # queueing waits for metadata
                    delivery = await self._producer.send(
                        self.topics.requests, payload, key=request_id.encode(), partition=partition
                    )
                    self.metrics.hops.observe(Hop.ADMISSION, time.perf_counter() - received)  # its CreateTime is now
                    await delivery
            except TimeoutError:
                # Not failed, only late: should Kafka take it after all, a cancel follows it to its worker.
                self._spawn(self._cancel_late(request_id))
                raise
            self.metrics.chats.labels(self.tier_of(conn.tenant)).inc()
        except (*REDIS_UNAVAILABLE, KafkaError) as exc:
            log.warning("could not admit chat %s: %r", request_id, exc)
            conn.close_chat(request_id)
            self.placer.in_flight.finish(request_id)
            await self.tenancy.end_stream(request_id)
            if routed:
                self._spawn(self._forget_route(request_id))
            raise ProtocolError(ErrorCode.UNAVAILABLE, "the service could not take this chat now; retry", frame.id) from exc

    async def cancel_chat(self, conn: Connection, chat_id: str) -> None:
        if self.regions.cancel(conn.conn_id, chat_id):
            return  # relayed: the peer region answers with `done`
        chat = conn.chat(chat_id)
        if chat is None:
            raise ProtocolError(ErrorCode.UNKNOWN_ID, f"no chat {chat_id!r} in flight on this socket", chat_id)
        # The worker answers with `done` (finish_reason "cancelled") on the token path. The
        # epoch is the one this socket holds the stream at: a cancel never reaches past a resume.
        try:
            await self._cancel_by_epoch({chat.request_id: chat.epoch})
        except KAFKA_DOWN as exc:
            raise ProtocolError(ErrorCode.UNAVAILABLE, "cannot cancel now; retry", chat_id) from exc

    async def resume_chat(self, conn: Connection, frame: ResumeFrame) -> None:
        """Move a stream to this connection; every refusal reads the same, revealing nothing."""
        self._check_new_chat(conn, frame.id)
        try:
            if not await self._routes.check_resume(frame.request_id, conn.tenant, frame.resume_token):
                raise ProtocolError(ErrorCode.RESUME_REFUSED, REFUSED_RESUME, frame.id)
            epoch, previous = await self._routes.move(frame.request_id, self.settings.edge_id, conn.conn_id)
        except REDIS_UNAVAILABLE as exc:
            raise ProtocolError(ErrorCode.UNAVAILABLE, "cannot resume now; retry", frame.id) from exc
        self._detached.pop(frame.request_id, None)
        await self.tenancy.adopt_stream(conn.tenant, frame.request_id)
        next_seq = frame.last_seq + 1
        conn.open_chat(frame.id, frame.request_id, next_seq=next_seq, epoch=epoch)
        conn.send(ResumedFrame(frame.id, frame.request_id, next_seq))
        old = previous or Route("", "")
        move = wire.Resume(
            frame.request_id, epoch, self.settings.edge_id, conn.conn_id, next_seq, old.edge_id, old.conn_id
        )
        try:
            await self._publish_control(move)
        except KAFKA_DOWN as exc:
            conn.close_chat(frame.request_id)
            raise ProtocolError(ErrorCode.UNAVAILABLE, "cannot resume now; retry", frame.id) from exc

    async def _cancel_late(self, request_id: str) -> None:
        try:
            await self._cancel_by_epoch({request_id: 0})  # its first epoch: a resume since is left alone
        except KAFKA_DOWN as exc:
            log.debug("no cancel for %s, which Kafka did not take in time: %r", request_id, exc)

    async def _cancel_by_epoch(self, epochs: dict[str, int]) -> None:
        by_epoch: dict[int, list[str]] = defaultdict(list)
        for request_id, epoch in epochs.items():
            by_epoch[epoch].append(request_id)
        for epoch, request_ids in by_epoch.items():
            await self._publish_control(wire.Cancel(request_ids, epoch))

    async def _publish_control(self, message: wire.Cancel | wire.Resume) -> None:
        """Waits for Kafka no longer than a new chat does: TimeoutError past that."""
        async with asyncio.timeout(self.settings.admit_timeout_s):
            await self._producer.send_and_wait(self.topics.control, self._seal.encode(self.topics.control, message))

    # Liveness ----------------------------------------------------------------------------
    def load(self) -> EdgeLoad:
        chats = sum(c.num_chats() for c in self._connections.values()) + self.regions.num_chats()
        return EdgeLoad(len(self._connections), chats)

    def worker_gone(self, worker_id: str, died: bool) -> None:
        """Gossip says a worker is gone. One that died ends its streams now; one that left in good
        order drained first, and the endings it sent are still on their way through Kafka."""
        if died:
            self.fail_worker(worker_id)
        else:
            asyncio.get_running_loop().call_later(WORKER_LEFT_GRACE_S, self.fail_worker, worker_id, False)

    def fail_worker(self, worker_id: str, died: bool = True) -> int:
        """A worker is gone: every stream it had started ends now, and none hangs.

        A stream that had already produced tokens survived at least one step: the
        client may retry it (`worker_lost`). One that was in its first step when the
        worker died is a suspect: it may be what took the worker down, so it is
        quarantined, not retried. A worker that left in good order took no one down.
        """
        failed = 0
        for conn in list(self._connections.values()):
            for chat in conn.chats():
                if chat.owner != worker_id:
                    continue
                if chat.order.next_seq > 0 or not died:
                    message = f"worker {worker_id} was lost mid-stream; retry the request"
                    error = wire.Error.of(chat.request_id, ErrorCode.WORKER_LOST, message)
                    if died and chat.order.next_seq > 0:  # tokens went out: the edge reports its usage
                        tier, delivered = self.tier_of(conn.tenant), chat.order.next_seq
                        self._spawn(self.meter.publish(self.meter.worker_died(chat.request_id, conn.tenant, tier, worker_id, delivered)))
                else:
                    message = f"worker {worker_id} died while starting this request; it is not run again"
                    error = wire.Error.of(chat.request_id, ErrorCode.REQUEST_QUARANTINED, message)
                self._deliver(conn, error)
                failed += 1
        if failed or died:
            log.warning("worker %s is gone: %d of its streams ended", worker_id, failed)
        return failed

    # Draining ----------------------------------------------------------------------------
    async def drain(self, timeout_s: float) -> None:
        """Admit nothing new; let the streams in flight finish, up to `timeout_s`; then close
        every socket as going away (1001), its unfinished streams left to be resumed elsewhere."""
        self.draining = True
        log.info("edge %s draining: %d chats in flight", self.settings.edge_id, self.load().chats)
        deadline = time.monotonic() + timeout_s
        while self.load().chats and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if left := self.load().chats:
            log.warning("drain timeout: closing sockets with %d chats in flight", left)
        await asyncio.gather(*(conn.go_away() for conn in list(self._connections.values())), return_exceptions=True)

    async def run_watchdog(self, period_s: float = 0.5) -> None:
        """Ends chats that stopped making progress, and cancels detached streams nobody resumed."""
        while True:
            await asyncio.sleep(period_s)
            now = time.monotonic()
            # Given up on here, so nobody may keep computing them either.
            expired: dict[str, int] = {}
            for conn in list(self._connections.values()):
                for chat in conn.chats():
                    if (late := overdue(chat, now, self._deadlines)) is not None:
                        code, message = late
                        log.warning("chat %s: %s (%s)", chat.request_id, code, message)
                        self._deliver(conn, wire.Error.of(chat.request_id, code, message))
                        expired[chat.request_id] = chat.epoch
            for request_id, (at, epoch) in list(self._detached.items()):
                if at <= now:
                    del self._detached[request_id]
                    expired[request_id] = epoch
                    self._spawn(self.tenancy.end_stream(request_id))  # nobody resumed it here
            if expired:
                with contextlib.suppress(Exception):
                    await self._cancel_by_epoch(expired)

    # Router side ---------------------------------------------------------------------
    def deliver(self, deliveries: list[wire.Delivery]) -> None:
        for delivery in deliveries:
            conn = self._connections.get(delivery.conn_id)
            if conn is None:
                self.placer.settled(delivery.event)
                continue
            try:
                self._deliver(conn, delivery.event, delivery.worker_id)
            except Exception:  # noqa: BLE001 - one bad event must not cost the rest of the frame
                log.exception("could not deliver an event of %s", delivery.event.request_id)

    def _deliver(self, conn: Connection, event: wire.Event, worker_id: str | None = None) -> None:
        """`worker_id`: the worker that sent the event; None for the edge's own (a deadline, a lost worker)."""
        self.placer.settled(event)
        delivered = conn.deliver(event, worker_id)
        if delivered is None:
            return
        if delivered.foreign:
            self._refused_event("dropped an event of %s from worker %s, which does not run it", event.request_id, worker_id)
            return
        self.metrics.observe(delivered)
        if delivered.sent and delivered.chat.order.finished:
            self.meter.forget(event.request_id)
            self._spawn(self._forget_route(event.request_id))
            self._spawn(self.tenancy.end_stream(event.request_id))

    async def _forget_route(self, request_id: str) -> None:
        try:
            await self._routes.delete(request_id)
        except REDIS_UNAVAILABLE as exc:
            log.debug("route of %s left to expire: %r", request_id, exc)  # it has a TTL

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def aclose(self) -> None:
        await self.regions.aclose()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
