"""The producer that outlives a broker outage, and the worker's token path over it, against a
stand-in for aiokafka's producer: a fatal delivery error means a fresh producer on the next send,
and a lost token batch ends its streams instead of leaving a gap."""

from __future__ import annotations

import asyncio
import logging

from aiokafka.errors import KafkaTimeoutError, OutOfOrderSequenceNumber

from services.worker.token_path import TokenPublisher
from shared import wire
from shared.producer import Producer
from shared.runtime import KafkaLogThrottle
from shared.seal import Seal


class StandIn:
    """Delivers or fails each record as told; counts its starts and stops."""

    made: list[StandIn] = []

    def __init__(self) -> None:
        self.fail_with: BaseException | None = None
        self.sent: list[tuple[str, bytes | None, bytes | None]] = []
        self.started = self.stopped = 0
        StandIn.made.append(self)

    async def start(self) -> None:
        self.started += 1

    async def stop(self) -> None:
        self.stopped += 1

    async def send(
        self, topic: str, value: bytes | None, key: bytes | None = None, partition: int | None = None
    ) -> asyncio.Future:
        self.sent.append((topic, value, key))
        delivery = asyncio.get_running_loop().create_future()
        if self.fail_with is None:
            delivery.set_result(None)
        else:
            delivery.set_exception(self.fail_with)
        return delivery


async def test_a_fatal_delivery_error_means_a_fresh_producer_on_the_next_send():
    StandIn.made.clear()
    producer = Producer(StandIn)
    await producer.start()
    first = StandIn.made[0]
    first.fail_with = KafkaTimeoutError()  # an ordinary failure: the producer goes on
    assert isinstance((await producer.send("t", b"1")).exception(), KafkaTimeoutError)
    first.fail_with = OutOfOrderSequenceNumber()
    assert isinstance((await producer.send("t", b"2")).exception(), OutOfOrderSequenceNumber)
    await asyncio.sleep(0)  # the delivery's callbacks run
    assert len(StandIn.made) == 1
    await producer.send_and_wait("t", b"3")
    fresh = StandIn.made[1]
    assert producer.num_replacements == 1 and fresh.started == 1 and first.stopped == 1
    assert fresh.sent == [("t", b"3", None)]


async def test_a_lost_token_batch_reports_its_streams_broken():
    StandIn.made.clear()
    producer = Producer(StandIn)
    await producer.start()
    broken: list[list[str]] = []
    tokens = TokenPublisher(producer, Seal(b"s", "worker-a"), "tokens", "worker-a", 1, broken.append)
    events = [wire.Token("r1", 0, "a"), wire.Token("r2", 0, "b"), wire.Token("r1", 1, "c")]
    assert await tokens.send("edge-0", events, {})
    StandIn.made[0].fail_with = KafkaTimeoutError()
    assert await tokens.send("edge-0", events, {}, wait=True) is False
    await tokens.send("edge-0", events[:1], {})  # not awaited: reported when the delivery fails
    await asyncio.sleep(0)
    assert broken == [["r1", "r2"], ["r1"]]


def test_the_kafka_client_cannot_flood_the_log(caplog):
    now = [0.0]
    throttle = KafkaLogThrottle(clock=lambda: now[0])
    records = [logging.LogRecord("aiokafka.conn", logging.ERROR, "", 0, "Unable connect to node %s", (1,), None) for _ in range(1000)]
    ours = logging.LogRecord("services.worker", logging.WARNING, "", 0, "ours", (), None)
    assert sum(throttle.filter(r) for r in records) == 3 and throttle.filter(ours)
    now[0] = 60.0
    late = logging.LogRecord("aiokafka.conn", logging.ERROR, "", 0, "Unable connect to node %s", (1,), None)
    assert throttle.filter(late) and late.getMessage() == "Unable connect to node 1 (997 similar lines not logged)"
