"""Cache-aware placement through the whole path: two `tiny` workers on the CPU publish their KV-cache
events, the edge indexes them, and a second chat on a prefix goes to the worker that holds it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from aiokafka import AIOKafkaProducer

from services.launcher.fleet import Fleet
from shared import wire
from shared.chat_client import ChatSocket
from shared.partition_owners import REQUESTS_ADDRESS, parse_partitions
from tests.conftest import FLEET_SEAL, KafkaTap, gossip_until, start_fleet

DOCUMENT = (
    "is a short text about rivers, bridges and the towns beside them. It tells how the water rises in spring, "
    "how the old stone arches hold, and why the ferry still runs at night when the bridge is closed."
)


# Each document's first chat goes where its first block hashes, so all of them land on one of the two
# workers with probability 2 ** (1 - DOCUMENTS): 1 in 32 at six documents, 1 in 2,048 at twelve.
DOCUMENTS = 12


@pytest.fixture(scope="module")
def tiny_fleet(topics, fleet_logs) -> Iterator[Fleet]:
    fleet = start_fleet(topics, fleet_logs, edges=1, routers=1, workers=2, model="tiny")
    yield fleet
    fleet.stop()


async def owners_known(fleet: Fleet, topics) -> None:
    """Until the edge's gossip carries both workers' share of the requests partitions."""

    def whole(rows: list[dict]) -> bool:
        owned = [parse_partitions(r["addresses"].get(REQUESTS_ADDRESS, "")) for r in rows if r["role"] == "worker"]
        return len(owned) == 2 and all(owned) and sum(map(len, owned)) == topics.requests_partitions

    await gossip_until(fleet, topics, whole, "the workers' partitions")


async def ask(sock: ChatSocket, chat_id: str, document: int, question: str) -> tuple[str, dict]:
    messages = [
        {"role": "system", "content": f"Document {document} {DOCUMENT}"},
        {"role": "user", "content": question},
    ]
    await sock.send({"type": "chat", "id": chat_id, "messages": messages, "max_tokens": 2, "temperature": 0})
    result = await sock.collect(chat_id, timeout=60)
    assert result.frames[0]["type"] == "accepted", result.frames
    assert result.final["type"] == "done", result.final
    return result.frames[0]["request_id"], result.final["usage"]


async def test_a_second_chat_on_a_prefix_goes_to_the_worker_that_holds_it(tiny_fleet, topics, infra):
    await owners_known(tiny_fleet, topics)
    sock = await ChatSocket.open(tiny_fleet.spec.chat_url(0))
    started: dict[str, str] = {}
    try:
        async with KafkaTap(infra, topics.tokens, topics.tokens_partitions) as tap:
            pairs = []
            for doc in range(DOCUMENTS):
                first, first_usage = await ask(sock, f"a{doc}", doc, "Why does the ferry run at night?")
                await asyncio.sleep(0.3)  # the worker's events (every 50 ms) reach the edge's index
                second, second_usage = await ask(sock, f"b{doc}", doc, "What holds the arches?")
                pairs.append((first, second, first_usage, second_usage))
            wanted = {rid for first, second, *_ in pairs for rid in (first, second)}
            deadline = time.monotonic() + 20
            while not wanted <= started.keys() and time.monotonic() < deadline:
                for batch in await tap.messages(wire.TokenBatch, 0.5):
                    started.update((e.request_id, e.worker_id) for e in batch.events if isinstance(e, wire.Started))
    finally:
        await sock.close()
    for first, second, first_usage, second_usage in pairs:
        assert first_usage["prompt_tokens"] >= 64 and first_usage["cached_tokens"] == 0
        assert started[second] == started[first]
        assert second_usage["cached_tokens"] >= 48, second_usage  # the system prompt's blocks, reused
    # The documents' first chats spread over both workers: placement is not one worker for all.
    assert len({started[first] for first, *_ in pairs}) == 2


async def test_bad_kv_events_records_do_not_stop_the_edge(tiny_fleet, topics, infra):
    producer = AIOKafkaProducer(bootstrap_servers=infra.kafka_bootstrap)
    await producer.start()
    try:
        forged = FLEET_SEAL.encode(topics.kv_events, wire.KvEvents("someone-else", 16, stored=[1]))
        unsealed = wire.encode(wire.KvEvents("worker-x", 16, stored=[1]))
        for value in (None, b"", b"\xc1\xc1", unsealed, forged, b"x" * 1000):
            await producer.send_and_wait(topics.kv_events, value, key=b"bad")
    finally:
        await producer.stop()
    await asyncio.sleep(0.5)
    # The edge still serves, and still reads the workers' events: each second chat finds its prefix
    # (on one of two workers, by chance, a one-in-eight pass for an edge that stopped reading).
    sock = await ChatSocket.open(tiny_fleet.spec.chat_url(0))
    try:
        for doc in (100, 101, 102):
            await ask(sock, f"a{doc}", doc, "Is the edge still serving?")
            await asyncio.sleep(0.3)
            _, usage = await ask(sock, f"b{doc}", doc, "And still reading?")
            assert usage["cached_tokens"] >= 48, usage
    finally:
        await sock.close()
