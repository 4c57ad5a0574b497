"""The worker service: Kafka requests in, engine on its own thread, token batches out.

Requests are taken in batches and their offsets committed once the engine holds
them. Every engine step becomes one Kafka message per destination edge, carrying
that step's events for all of the edge's requests, each tagged with its seq.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from cachetools import TTLCache

from services.worker.config import WorkerConfig
from services.worker.engine.sampling_params import SamplingParams
from services.worker.engine_thread import EngineThread
from services.worker.generation import GenerationEngine, GenerationRequest, StepOutput, Usage
from shared import wire
from shared.kafka_clients import make_consumer, make_producer, send_dead_letter

log = logging.getLogger(__name__)

POLL_TIMEOUT_MS = 100
CANCELLED_MEMORY_S = 600  # a cancel may overtake its request; remember it this long


@dataclass
class InFlight:
    edge_id: str
    next_seq: int = 0


class WorkerService:
    def __init__(self, config: WorkerConfig, engine: GenerationEngine) -> None:
        self.config = config
        self.topics = config.topics
        self._engine = engine
        self._in_flight: dict[str, InFlight] = {}
        self._cancelled: TTLCache[str, bool] = TTLCache(maxsize=100_000, ttl=CANCELLED_MEMORY_S)
        self._outbox: asyncio.Queue[list[StepOutput]] = asyncio.Queue()
        self._producer: AIOKafkaProducer | None = None
        self._thread: EngineThread | None = None
        self.num_dead_letters = 0

    async def run(self, ready: asyncio.Event | None = None) -> None:
        name = self.config.name
        bootstrap = self.config.kafka_bootstrap
        producer = self._producer = make_producer(bootstrap, client_id=name)
        requests = make_consumer(
            bootstrap, self.topics.requests, client_id=name, group_id=f"{self.topics.prefix}-workers"
        )
        # Every worker must see every cancel, so the control topic is read without a group.
        control = make_consumer(
            bootstrap, self.topics.control, client_id=name, group_id=None, auto_offset_reset="latest"
        )
        await producer.start()
        await requests.start()
        await control.start()
        self._thread = EngineThread(self._engine, asyncio.get_running_loop(), self._outbox.put_nowait)
        self._thread.start()
        log.info("worker %s ready (model %s)", name, self.config.model)
        if ready is not None:
            ready.set()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._consume_requests(requests))
                tasks.create_task(self._consume_control(control))
                tasks.create_task(self._publish_outputs())
        finally:
            self._thread.stop()
            for client in (requests, control):
                with contextlib.suppress(Exception):
                    await client.stop()
            await producer.stop()

    async def _consume_requests(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            batches = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS, max_records=self.config.max_poll_records)
            for records in batches.values():
                for record in records:
                    await self._accept(record)
            if batches:
                # The engine thread now holds every request of the batch.
                await consumer.commit()

    async def _accept(self, record: ConsumerRecord) -> None:
        try:
            chat = wire.decode(record.value, wire.ChatRequest)
        except wire.WireError as exc:
            await self._dead_letter(record, str(exc))
            return
        self._in_flight[chat.request_id] = InFlight(chat.edge_id)
        if self._cancelled.pop(chat.request_id, None):
            self._outbox.put_nowait([StepOutput(chat.request_id, finish_reason="cancelled", usage=Usage(0, 0, 0))])
            return
        sampling = SamplingParams(
            max_tokens=chat.max_tokens, temperature=chat.temperature, top_p=chat.top_p, seed=chat.seed
        )
        try:
            sampling.validate()
        except ValueError as exc:
            self._outbox.put_nowait([StepOutput(chat.request_id, error_code="invalid_request", error_message=str(exc))])
            return
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        self._thread.add(GenerationRequest(chat.request_id, chat.tenant, messages, sampling))

    async def _consume_control(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            batches = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
            for records in batches.values():
                for record in records:
                    try:
                        cancel = wire.decode(record.value, wire.Cancel)
                    except wire.WireError as exc:
                        await self._dead_letter(record, str(exc))
                        continue
                    for request_id in cancel.request_ids:
                        if request_id in self._in_flight:
                            self._thread.abort(request_id)
                        else:
                            self._cancelled[request_id] = True

    async def _publish_outputs(self) -> None:
        while True:
            outputs = await self._outbox.get()
            by_edge: dict[str, list[wire.Event]] = defaultdict(list)
            for output in outputs:
                state = self._in_flight.get(output.request_id)
                if state is None:
                    continue  # finished or never ours: nothing more may be said about it
                events = _events_for(output, state)
                if output.finished:
                    del self._in_flight[output.request_id]
                by_edge[state.edge_id].extend(events)
            for edge_id, events in by_edge.items():
                batch = wire.TokenBatch(edge_id, self.config.name, events, sent_at=time.time())
                await self._producer.send(self.topics.tokens, wire.encode(batch), key=edge_id.encode())

    async def _dead_letter(self, record: ConsumerRecord, reason: str) -> None:
        self.num_dead_letters += 1
        await send_dead_letter(self._producer, self.topics.dead_letter, record, self.config.name, reason)



def _events_for(output: StepOutput, state: InFlight) -> list[wire.Event]:
    """The output as seq-numbered events: its text as a token, then its ending if it ended."""
    events: list[wire.Event] = []
    if output.text:
        events.append(wire.Token(output.request_id, state.next_seq, output.text))
        state.next_seq += 1
    if output.error_code is not None:
        events.append(wire.Error(output.request_id, state.next_seq, output.error_code, output.error_message, False))
    elif output.finish_reason is not None:
        usage = output.usage
        events.append(
            wire.Done(
                output.request_id,
                state.next_seq,
                output.finish_reason,
                wire.Usage(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens),
            )
        )
    return events
