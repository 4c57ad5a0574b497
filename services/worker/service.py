"""The worker service: Kafka requests in, engine on its own thread, token batches out.

Offsets are committed once a request has started (see offset_tracker.py). Every
engine step becomes one Kafka message per destination edge (and token shard),
carrying that step's events for the edge's requests, each tagged with its seq. A request that
another worker started is never run here: if that worker is gone, the request is
quarantined, since it may be what took the worker down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Callable

from aiokafka import (
    AIOKafkaConsumer,
    ConsumerRebalanceListener,
    ConsumerRecord,
    TopicPartition,
)
from aiokafka.errors import KafkaError
from cachetools import TTLCache
from prometheus_client import CollectorRegistry

from services.worker.convert import engine_request
from services.worker.decode_role import DecodeRole
from services.worker.decoder_choice import Decoder
from services.worker.engine.types import (
    EngineOutput,
    Failure,
    FailureCode,
    FinishReason,
    GenerationEngine,
    HandoffEngine,
    Usage,
)
from services.worker.engine_thread import EngineThread
from services.worker.kv_events import KVEventCollector, publish_kv_events
from services.worker.metering import WorkerMeter
from services.worker.metrics import WorkerMetrics
from services.worker.offset_tracker import OffsetTracker
from services.worker.prefill_role import PrefillRole
from services.worker.settings import WorkerSettings
from services.worker.streams import Stream, StreamRegistry
from services.worker.token_path import TokenPublisher
from shared import wire
from shared.codes import ErrorCode
from shared.fleet_membership import is_alive
from shared.health import Health, Lifecycle
from shared.hop_timing import Hop, produced_at
from shared.kafka_clients import DeadLetters, make_consumer, make_producer
from shared.kafka_shutdown import commit_bounded, stop_client
from shared.membership import Membership
from shared.metering.publisher import UsagePublisher
from shared.metering.records import UsageContext
from shared.metrics import watch_consumer_lag
from shared.producer import Producer
from shared.redis_client import REDIS_UNAVAILABLE
from shared.routing_map import RoutingMap
from shared.seal import Seal
from shared.status_server import status_endpoint

log = logging.getLogger(__name__)

POLL_TIMEOUT_MS = 100
COMMIT_PERIOD_S = 0.1
CANCELLED_MEMORY_S = 600  # a cancel may overtake its request; remember it this long
START_RECORD_TIMEOUT_S = 5.0
EDGE_LOSS_GRACE_S = 1.0
BROKEN_TELL_S = 60.0  # how long to keep trying to tell edges of streams Kafka lost: past their progress deadline
DRAIN_POLL_S = 0.1
FLUSH_TIMEOUT_S = 10.0  # the drain's last messages reach Kafka, or are given up on


class _Revocations(ConsumerRebalanceListener):
    def __init__(self, service: WorkerService) -> None:
        self._service = service

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        unstarted = self._service.offsets.forget_partitions(set(revoked))
        log.info("partitions revoked: %s; %d requests not started are left to their next owner", sorted(revoked), len(unstarted))
        self._service.drop_unstarted(unstarted)
        self._service.assignment_changed(set())

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._service.assignment_changed(assigned)
        self._service.announce_serving()


class WorkerService:
    def __init__(
        self,
        settings: WorkerSettings,
        engine: GenerationEngine,
        routes: RoutingMap,
        is_alive: Callable[[str], bool],
        health: Health | None = None,
        on_assignment: Callable[[frozenset[int]], None] | None = None,
        decoders: Callable[[dict[str, int]], list[Decoder]] = lambda in_flight: [],
        advertise_kv: Callable[[str], None] = lambda address: None,
    ) -> None:
        self.settings = settings
        self.topics = settings.topics
        self.health = health or Health("worker", settings.name)
        self._on_assignment = on_assignment  # told the requests partitions this worker owns (gossip)
        # Disaggregated roles (prefill_role.py, decode_role.py): whom to hand requests to, where to take them.
        self._decoders, self._advertise_kv = decoders, advertise_kv
        self._prefill: PrefillRole | None = None
        self._decode: DecodeRole | None = None
        if settings.role != "unified" and not isinstance(engine, HandoffEngine):
            raise ValueError(f"a {settings.role} worker hands KV caches on; this engine has none (the echo model?)")
        self._seal = Seal(settings.fleet_secret, settings.name)
        self.offsets = OffsetTracker()
        self._engine = engine
        self._routes = routes
        self._is_alive = is_alive
        self._streams = StreamRegistry(grace_s=settings.replay_retention_s)
        # Cancels that came before their request: request id -> the edge that sent it.
        self._cancelled: TTLCache[str, str] = TTLCache(maxsize=100_000, ttl=CANCELLED_MEMORY_S)
        self._outbox: asyncio.Queue[list[EngineOutput]] = asyncio.Queue()
        self._producer: Producer | None = None
        self._thread: EngineThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tokens: TokenPublisher | None = None
        self._dead_letters: DeadLetters | None = None
        self._meter: WorkerMeter | None = None
        self._background: set[asyncio.Task] = set()
        self.registry = CollectorRegistry()
        self.metrics = WorkerMetrics(self.registry, engine.load)

    async def run(self, stopping: asyncio.Event | None = None) -> None:
        """Serve until `stopping` is set, then drain (see `_drain`) and return."""
        stopping = stopping or asyncio.Event()
        name, kafka = self.settings.name, self.settings.kafka
        producer = self._producer = make_producer(kafka, client_id=name)
        self._dead_letters = DeadLetters(producer, self.topics.dead_letter, name)
        self._tokens = TokenPublisher(producer, self._seal, self.topics.tokens, name, self.settings.token_shards, self._break_streams)
        usage = UsagePublisher(producer, self._seal, self.topics.usage, self.metrics.usage_records)
        self._meter = WorkerMeter(usage, name)  # metering.py: one usage record per stream it ends
        # A decode worker takes its requests from prefill workers (the KV link), none from Kafka.
        requests = None if self.settings.role == "decode" else make_consumer(kafka, client_id=name, group_id=f"{self.topics.prefix}-workers")
        if requests is not None:
            requests.subscribe([self.topics.requests], listener=_Revocations(self))
        # Every worker must see every control message, so that topic is read without a group.
        control = make_consumer(kafka, self.topics.control, client_id=name, group_id=None, auto_offset_reset="latest")
        await producer.start()
        if requests is not None:
            await requests.start()
        await control.start()
        lag = watch_consumer_lag(requests, self.registry) if requests is not None else None
        self._loop = asyncio.get_running_loop()
        self._engine.start_listener = self._record_starts
        self._thread = EngineThread(self._engine, self._loop, self._outbox.put_nowait)
        kv_events = KVEventCollector()
        self._engine.kv_listener = kv_events  # before the thread starts: the engine reads it there
        self._thread.start()
        await self._start_role()
        metrics = self.settings.metrics
        try:
            async with status_endpoint(self.registry, self.health, metrics.host, metrics.port), asyncio.TaskGroup() as tasks:
                consuming = tasks.create_task(self._consume_requests(requests, stopping)) if requests is not None else None
                rest = [tasks.create_task(self._consume_control(control)), tasks.create_task(self._publish_outputs())]
                rest.append(tasks.create_task(self._publish_kv_events(kv_events)))
                await stopping.wait()
                await self._drain(requests, consuming)
                for task in rest:
                    task.cancel()
        finally:
            self.health.set(Lifecycle.STOPPED)
            if lag is not None:
                lag.cancel()
            for task in self._background:
                task.cancel()
            await self._stop_role()
            self._thread.stop()
            for client in (requests, control):
                if client is not None:
                    await stop_client(client)
            await producer.stop()

    # Roles ---------------------------------------------------------------------------------------
    async def _start_role(self) -> None:
        name, secret, link = self.settings.name, self.settings.fleet_secret, self.settings.kv_link
        engine = self._engine
        if self.settings.role != "unified":
            log.info("worker %s runs as a %s worker", name, self.settings.role)
        if self.settings.role == "prefill":
            self._prefill = PrefillRole(name, secret, link, self._thread, engine.read_kv_layer, self._decoders, self._streams, self._tokens, self.metrics)
        elif self.settings.role == "decode":
            self._decode = DecodeRole(
                name, secret, link, self._thread, engine.write_kv_layer, engine.kv_layout, self._streams, self._tokens, self._cancelled,
                self.metrics,
            )
            self._advertise_kv(await self._decode.start())
            self.announce_serving()  # it owns no partitions: it serves once it listens

    async def _stop_role(self) -> None:
        if self._prefill is not None:
            self._prefill.stop()
        if self._decode is not None:
            await self._decode.stop()

    # Draining -----------------------------------------------------------------------------
    async def _drain(self, requests: AIOKafkaConsumer | None, consuming: asyncio.Task | None) -> None:
        """Take nothing new, hand back what has not started, finish what runs, within the drain timeout.

        The requests consumer leaves its group now, so the partitions move at once and their
        new owner re-reads every request that had not started here (their offsets were never
        committed). Running streams go on (cancels and resumes still arrive on the control
        topic); those still running at the timeout end with `worker_draining`. Gossip is left
        only after this returns, so no edge takes a finished stream for a lost one.
        """
        log.info("worker %s draining: %d streams running", self.settings.name, len(self._streams.active))
        if requests is not None and consuming is not None:
            await consuming
            await commit_bounded(requests, self.offsets.committable())
            self.drop_unstarted(self.offsets.forget_partitions(set(requests.assignment())))
            await stop_client(requests)  # leaves the group: a rebalance, not a session timeout
            self.assignment_changed(set())
        elif self._decode is not None:
            await self._decode.stop()  # takes no more handoffs
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self._streams.active and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self._streams.active:
            await self._end_draining(list(self._streams.active))
        try:
            await asyncio.wait_for(self._producer.flush(), FLUSH_TIMEOUT_S)
        except (TimeoutError, KafkaError) as exc:
            log.warning("drain: the last token batches may be lost: %r", exc)
        log.info("worker %s drained", self.settings.name)

    async def _end_draining(self, request_ids: list[str]) -> None:
        """The streams the drain timeout overtook: each ends with a retryable error, in seq order."""
        log.warning("drain timeout: ending %d running streams with %s", len(request_ids), ErrorCode.WORKER_DRAINING)
        message = "the worker stopped before this stream finished; retry the request"
        by_edge: dict[str, list[wire.Event]] = defaultdict(list)
        epochs: dict[str, dict[str, int]] = defaultdict(dict)
        taken = self._take_streams(request_ids)
        await self._meter.worker_ended(taken, ErrorCode.WORKER_DRAINING)
        for stream in taken:
            error = wire.Error.of(stream.request_id, ErrorCode.WORKER_DRAINING, message, stream.next_seq)
            stream.log.append(error)
            by_edge[stream.edge_id].append(error)
            if stream.epoch:
                epochs[stream.edge_id][stream.request_id] = stream.epoch
        sends = (self._tokens.send(edge_id, events, epochs[edge_id], wait=True) for edge_id, events in by_edge.items())
        if not all(await asyncio.gather(*sends)):
            log.warning("drain: the end of some streams could not be sent; their edges' deadlines end them")

    def _take_streams(self, request_ids: list[str]) -> list[Stream]:
        """These streams end here: out of the registry (what the engine still says of them is
        dropped) and out of the engine, without a word from it."""
        taken = [stream for rid in request_ids if (stream := self._streams.active.get(rid)) is not None]
        for stream in taken:
            self._streams.end(stream.request_id)
            self._thread.drop(stream.request_id)
        return taken

    # Requests -----------------------------------------------------------------------------
    async def _consume_requests(self, consumer: AIOKafkaConsumer, stopping: asyncio.Event) -> None:
        committer = asyncio.create_task(self._commit_started(consumer))
        try:
            await self._consume_until(consumer, stopping)
        finally:
            committer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await committer

    async def _commit_started(self, consumer: AIOKafkaConsumer) -> None:
        """Commit the offsets of started requests off the consuming loop: a commit is a broker
        round trip (aiokafka#128: at times far longer), and the next poll's requests must not wait
        behind it. What it has not committed yet, a redelivery finds claimed (see `_accept`)."""
        while True:
            await asyncio.sleep(COMMIT_PERIOD_S)
            if moves := self.offsets.committable():
                try:
                    await consumer.commit(moves)
                except KafkaError as exc:  # the broker is away, or a rebalance took the partitions
                    log.warning("commit failed (a later one covers these offsets): %r", exc)

    async def _consume_until(self, consumer: AIOKafkaConsumer, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            batches = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS, max_records=self.settings.max_poll_records)
            polled = time.time()
            chats: list[tuple[TopicPartition, int, wire.ChatRequest]] = []
            for tp, records in batches.items():
                for record in records:
                    try:
                        _, chat = self._seal.decode(record.topic, record.value, wire.ChatRequest)
                        chats.append((tp, record.offset, chat))
                        self.metrics.hops.observe(Hop.REQUEST_KAFKA, polled - produced_at(record))
                    except wire.WireError as exc:
                        await self._dead_letter(record, str(exc))
                        self.offsets.add(tp, record.offset, None)
            owners = await self._owners([chat.request_id for _, _, chat in chats])
            for tp, offset, chat in chats:
                self.offsets.add(tp, offset, await self._accept(chat, owners.get(chat.request_id), polled))

    async def _accept(self, chat: wire.ChatRequest, owner: str | None, consumed_at: float = 0.0) -> str | None:
        """Hand the request to the engine; its id if its start is still to come, else None."""
        if chat.request_id in self._streams.active:
            return None  # delivered twice after a rebalance: ours already
        if self._cancelled.pop(chat.request_id, None) == chat.edge_id:
            self._streams.open(chat.request_id, chat.edge_id)
            self._outbox.put_nowait([EngineOutput(chat.request_id, finish_reason=FinishReason.CANCELLED, usage=Usage(0, 0, 0))])
            return None
        if owner is not None and owner != self.settings.name:
            if not self._is_alive(owner):
                await self._quarantine(chat, owner)
            return None
        stream = self._streams.open(chat.request_id, chat.edge_id)
        stream.usage, stream.consumed_at = UsageContext.of(chat), consumed_at
        try:
            request = engine_request(chat)
        except ValueError as exc:  # the wire schema holds the same limits: only a skewed peer gets here
            failure = Failure(FailureCode.INVALID_REQUEST, str(exc))
            self._outbox.put_nowait([EngineOutput(chat.request_id, failure=failure)])
            return None
        self.metrics.requests.inc()
        if self._prefill is not None and request.constraint is None and chat.max_tokens > 1:
            stream.request = chat  # handed on with its KV once its first token is out
            request = dataclasses.replace(request, handoff=True)
        self._thread.add(request)
        return chat.request_id

    async def _owners(self, request_ids: list[str]) -> dict[str, str]:
        """Who already started these requests, in one round trip for the whole poll."""
        if not request_ids:
            return {}
        try:
            return await self._routes.owners(request_ids)
        except REDIS_UNAVAILABLE as exc:
            log.warning("cannot read the claims of %d requests (%s); running them", len(request_ids), exc)
            return {}

    async def _quarantine(self, chat: wire.ChatRequest, owner: str) -> None:
        self.metrics.quarantined.inc()
        log.warning("quarantining %s: worker %s died while running it", chat.request_id, owner)
        message = "a worker died while running this request; it is not run again"
        error = wire.Error.of(chat.request_id, ErrorCode.REQUEST_QUARANTINED, message)
        await self._tokens.send(chat.edge_id, [error], {})

    def announce_serving(self) -> None:
        """Serving once the group has given this worker its share of the partitions."""
        if self.health.state is Lifecycle.STARTING:
            log.info("worker %s serving (model %s)", self.settings.name, self.settings.model)
        self.health.set(Lifecycle.SERVING)

    def assignment_changed(self, assigned: set[TopicPartition]) -> None:
        """The group moved the requests partitions: tell the fleet which are this worker's now."""
        if self._on_assignment is not None:
            self._on_assignment(frozenset(tp.partition for tp in assigned if tp.topic == self.topics.requests))

    async def _publish_kv_events(self, collector: KVEventCollector) -> None:
        interval_s = self.settings.kv_events_interval_s
        if interval_s > 0:
            block_size = self.settings.engine.block_size
            await publish_kv_events(collector, self._producer, self._seal, self.topics.kv_events, block_size, interval_s)

    def drop_unstarted(self, request_ids: list[str]) -> None:
        """Requests of partitions taken away before they started: their new owner runs them."""
        for request_id in request_ids:
            self._streams.active.pop(request_id, None)
            self._thread.drop(request_id)

    def _record_starts(self, request_ids: list[str]) -> None:
        """Engine thread: put the starts on the token path, and wait until Kafka has them."""
        future = asyncio.run_coroutine_threadsafe(self._announce_starts(request_ids), self._loop)
        try:
            future.result(START_RECORD_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the engine goes on; the claim is best effort now
            log.warning("could not record the start of %d requests: %r", len(request_ids), exc)

    async def _announce_starts(self, request_ids: list[str]) -> None:
        by_edge: dict[str, list[wire.Event]] = defaultdict(list)
        for request_id in request_ids:
            self.offsets.started(request_id)
            stream = self._streams.active.get(request_id)
            if stream is not None:
                started = wire.Started(request_id, wire.OUT_OF_BAND, self.settings.name)
                stream.log.append(started)
                by_edge[stream.edge_id].append(started)
        await asyncio.gather(*(self._tokens.send(edge, events, {}, wait=True) for edge, events in by_edge.items()))

    # Control ------------------------------------------------------------------------------
    async def _consume_control(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            batches = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
            for records in batches.values():
                for record in records:
                    try:
                        sender, message = self._seal.decode(record.topic, record.value, wire.Control)
                    except wire.WireError as exc:
                        await self._dead_letter(record, str(exc))
                        continue
                    if isinstance(message, wire.Cancel):
                        self._cancel(message, sender)
                    else:
                        await self._resume(message)

    def _cancel(self, cancel: wire.Cancel, sender: str) -> None:
        """Only the edge that holds a stream may cancel it, at the epoch it holds it at."""
        for request_id in cancel.request_ids:
            stream = self._streams.active.get(request_id)
            if stream is None:
                self._cancelled[request_id] = sender
            elif stream.edge_id == sender and stream.epoch <= cancel.epoch:  # else it moved since
                self._thread.abort(request_id)

    def cancel_edge(self, edge_id: str) -> None:
        """The edge is gone, and with it its sockets: free what its requests hold."""
        for request_id in self._streams.on_edge(edge_id):
            self._thread.abort(request_id)

    def cancel_edge_unless_back(self, edge_id: str, membership: Membership) -> None:
        """Cancel a departed edge's requests once it has stayed gone a moment: an overloaded
        edge wrongly declared dead refutes and returns, and its streams must go on."""

        def check() -> None:
            if not is_alive(membership, edge_id):
                self.cancel_edge(edge_id)

        self._loop.call_later(EDGE_LOSS_GRACE_S, check)

    async def _resume(self, resume: wire.Resume) -> None:
        stream = self._streams.find(resume.request_id)
        if stream is None or resume.epoch <= stream.epoch:
            return  # another worker's, or an old message
        if resume.old_edge_id and resume.old_conn_id:
            # The socket it left may still be open: tell it now, not at its progress deadline.
            moved = wire.Moved(resume.request_id, wire.OUT_OF_BAND, resume.old_conn_id, resume.epoch)
            await self._tokens.send(resume.old_edge_id, [moved], {})
        stream.edge_id, stream.epoch = resume.edge_id, resume.epoch
        events = stream.replay_from(resume.from_seq)
        if events is None:
            message = f"last_seq {resume.from_seq - 1} is beyond the {stream.next_seq} events sent"
            events = [wire.Error.of(resume.request_id, ErrorCode.RESUME_REFUSED, message)]
        await self._tokens.send(stream.edge_id, events, {resume.request_id: stream.epoch})

    # Tokens out ---------------------------------------------------------------------------
    async def _publish_outputs(self) -> None:
        while True:
            outputs = await self._outbox.get()
            now = time.time()
            by_edge: dict[str, list[wire.Event]] = defaultdict(list)
            epochs: dict[str, dict[str, int]] = defaultdict(dict)
            handoffs = []
            for output in outputs:
                stream = self._streams.active.get(output.request_id)
                if stream is None:
                    continue  # dropped or finished: nothing more may be said about it
                if output.handoff is not None and self._prefill is not None:
                    handoffs.append((stream, output.handoff))
                first = stream.next_seq == 0
                by_edge[stream.edge_id].extend(stream.events_for(output))
                if first and stream.next_seq and stream.consumed_at:
                    self.metrics.hops.observe(Hop.WORKER_START, now - stream.consumed_at)
                if stream.epoch:
                    epochs[stream.edge_id][stream.request_id] = stream.epoch
                if output.finished:
                    await self._meter.output_ended(stream, output)  # queued before the batch that ends it
                    self._streams.end(output.request_id)
                    self.offsets.started(output.request_id)  # ended before starting: nothing holds its offset
            for edge_id, events in by_edge.items():
                self.metrics.tokens.inc(sum(isinstance(e, wire.Token) for e in events))
                self.metrics.batches.inc()
                await self._tokens.send(edge_id, events, epochs[edge_id])
            for stream, ready in handoffs:  # after its first token went out
                self._prefill.start(stream, ready)

    def _break_streams(self, request_ids: list[str]) -> None:
        """Kafka lost some of these streams' events: they end here, and their edges are told (token_path.py)."""
        by_edge: dict[str, dict[str, int]] = defaultdict(dict)
        taken = self._take_streams(request_ids)
        self._keep(asyncio.create_task(self._meter.worker_ended(taken, ErrorCode.UNAVAILABLE)))
        for stream in taken:
            by_edge[stream.edge_id][stream.request_id] = stream.epoch
            self.offsets.started(stream.request_id)  # its start may be what was lost: it must not hold the offset
        for edge_id, epochs in by_edge.items():
            self._keep(asyncio.create_task(self._tokens.tell_broken(edge_id, epochs, BROKEN_TELL_S)))

    def _keep(self, task: asyncio.Task) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _dead_letter(self, record: ConsumerRecord, reason: str) -> None:
        self.metrics.dead_letters.inc()
        await self._dead_letters.park(record, reason)

