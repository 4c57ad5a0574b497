"""A worker's token publisher waiting for Kafka: every shard's message is queued before it waits for any."""

from __future__ import annotations

import asyncio

from aiokafka.errors import KafkaTimeoutError

from services.worker.token_path import TokenPublisher
from shared import wire
from shared.seal import Seal


class HeldDeliveries:
    """A producer whose deliveries complete only when the test says so."""

    def __init__(self) -> None:
        self.deliveries: list[asyncio.Future] = []

    async def send(self, topic: str, value: bytes | None, key: bytes | None = None, partition: int | None = None) -> asyncio.Future:
        self.deliveries.append(asyncio.get_running_loop().create_future())
        return self.deliveries[-1]


async def test_a_waited_send_queues_every_shard_before_waiting():
    producer, broken = HeldDeliveries(), []
    tokens = TokenPublisher(producer, Seal(b"s", "w"), "tokens", "w", 4, broken.append)  # type: ignore[arg-type]
    starts = [wire.Started(f"r{i}", wire.OUT_OF_BAND, "w") for i in range(40)]  # spread over all 4 shards
    sending = asyncio.create_task(tokens.send("edge-0", starts, {}, wait=True))
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(producer.deliveries) == 4 and not sending.done()  # one round trip for all, not one each
    producer.deliveries[0].set_exception(KafkaTimeoutError())
    for delivery in producer.deliveries[1:]:
        delivery.set_result(None)
    assert await sending is False
    assert len(broken) == 1 and set(broken[0]) < {s.request_id for s in starts}
