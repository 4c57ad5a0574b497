"""Records, frames and messages from outside the fleet, or from a member speaking out of turn:
none stops a consumer (not even after a restart), and none gets into anyone's stream."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import pytest
from aiokafka import AIOKafkaProducer

from shared import wire
from shared.chat_client import ChatSocket
from shared.codes import FinishReason
from shared.framing import read_frame, write_frame
from shared.redis_client import make_cluster
from shared.routing_map import claim_key, route_key
from shared.seal import Seal
from shared.service_settings import RedisSettings
from tests.conftest import FLEET_SEAL, FLEET_SECRET, KafkaTap
from tests.fault.conftest import finish, intact, start_streams

CONSUMERS = ("router-0", "router-1", "worker-0", "worker-1")


def poison(topic: str, wrong_kind: msgspec.Struct, wrong_version: msgspec.Struct) -> dict[str, bytes | None]:
    """Every kind of record a consumer of `topic` might meet that is not a message it can use."""
    return {
        "null": None,
        "empty": b"",
        "garbage": b"\xc1\x00garbage",
        "unsealed": wire.encode(wrong_version),
        "wrong secret": Seal(b"not the fleet secret", "edge-0").encode(topic, wrong_version),
        "wrong schema": FLEET_SEAL.encode(topic, wrong_kind),
        "wrong version": FLEET_SEAL.seal(topic, msgspec.msgpack.encode({**msgspec.msgpack.decode(wire.encode(wrong_version)), "v": 99})),
    }


def alive(fleet, names=CONSUMERS) -> list[str]:
    return [name for name in names if fleet.children[name].process.poll() is None]


async def produce(bootstrap: str, topic: str, records: dict[str, bytes | None]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for name, value in records.items():
            await producer.send_and_wait(topic, value, key=name.encode())
    finally:
        await producer.stop()


async def test_poison_on_every_topic_stops_no_consumer_before_or_after_a_restart(make_fleet, infra, topics):
    fleet = make_fleet(edges=1, routers=2, workers=2, echo_delay_ms=5)
    chat = wire.ChatRequest("r-poison", "edge-0", "c", "dev", [wire.Message("user", "x")])
    batch = wire.TokenBatch("edge-0", "w", [wire.Token("r-poison", 0, "x")])
    cancel = wire.Cancel(["r-poison"])
    records = {
        topics.requests: poison(topics.requests, cancel, chat),
        topics.control: poison(topics.control, batch, cancel),
        topics.tokens: poison(topics.tokens, chat, batch),
    }
    async with KafkaTap(infra, topics.dead_letter, topics.dead_letter_partitions) as letters:
        for topic, values in records.items():
            await produce(infra.kafka_bootstrap, topic, values)
        parked: list[wire.DeadLetter] = []
        deadline = time.monotonic() + 20
        # Requests and tokens are read by one consumer group each; control by every worker.
        expected = len(records[topics.requests]) + len(records[topics.tokens]) + 2 * len(records[topics.control])
        while len(parked) < expected and time.monotonic() < deadline:
            parked += [wire.decode(v, wire.DeadLetter) for v in await letters.records(0.5)]
        by_topic = {topic: sorted(p.payload for p in parked if p.source_topic == topic) for topic in records}
        for topic, values in records.items():
            copies = 2 if topic == topics.control else 1
            assert by_topic[topic] == sorted([v or b"" for v in values.values()] * copies), topic
        assert all(letter.reason for letter in parked)
        assert alive(fleet) == list(CONSUMERS)

        # The offsets were committed: consumers started again never meet the poison.
        await asyncio.sleep(1.0)  # past the routers' commit period
        for name in ("router-0", "worker-0"):
            fleet.kill(name)
            fleet.start_child(fleet.spec.child(name))
        await asyncio.to_thread(fleet.wait_ready, 60)
        sockets, _ = await start_streams(fleet.spec.chat_url(0), 4)
        results = await finish(sockets)
        assert all(intact(r) for r in results), [r.final for r in results]
        assert [v for v in await letters.records(2.0)] == []
    assert alive(fleet) == list(CONSUMERS)


async def victim_stream(fleet) -> tuple[ChatSocket, dict]:
    """A stream under way: its worker has claimed it, so only that worker may add to it."""
    sockets, accepted = await start_streams(fleet.spec.chat_url(0), 1)
    redis = make_cluster(RedisSettings())
    try:
        for _ in range(100):
            if await redis.get(claim_key(accepted[0]["request_id"])):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the stream was never started")
    finally:
        await redis.aclose()
    await asyncio.sleep(0.2)  # the start is routed to the edge right after it is claimed
    return sockets[0], accepted[0]


async def test_forged_tokens_and_cancels_on_kafka_never_reach_a_stream(make_fleet, infra, topics):
    fleet = make_fleet(edges=1, routers=1, workers=1, echo_delay_ms=20)
    sock, accepted = await victim_stream(fleet)
    rid = accepted["request_id"]
    forged_batch = wire.TokenBatch("edge-0", "worker-0", [wire.Token(rid, 40, "INJECTED "), wire.Done(rid, 41, FinishReason.STOP, wire.Usage(1, 0, 1))])
    # A member holding the secret, but not the worker running the stream, speaking in its own name.
    impostor = wire.TokenBatch("edge-0", "test", [wire.Token(rid, 42, "INJECTED "), wire.Done(rid, 43, FinishReason.STOP, wire.Usage(1, 0, 1))])
    await produce(infra.kafka_bootstrap, topics.tokens, {
        "bare": wire.encode(forged_batch),
        "wrong secret": Seal(b"guess", "worker-0").encode(topics.tokens, forged_batch),
        "impostor": FLEET_SEAL.encode(topics.tokens, impostor),
    })
    await produce(infra.kafka_bootstrap, topics.control, {
        "bare cancel": wire.encode(wire.Cancel([rid])),
        "wrong secret cancel": Seal(b"guess", "edge-0").encode(topics.control, wire.Cancel([rid])),
        # A member, but not the edge holding the stream: only that edge may cancel it.
        "another edge's cancel": Seal(FLEET_SECRET, "edge-9").encode(topics.control, wire.Cancel([rid])),
    })
    (result,) = await finish([sock])
    assert intact(result), result.final
    assert "INJECTED" not in result.text


async def test_an_unauthenticated_router_link_is_refused_and_injects_nothing(make_fleet):
    fleet = make_fleet(edges=1, routers=1, workers=1, echo_delay_ms=20)
    sock, accepted = await victim_stream(fleet)
    rid = accepted["request_id"]
    redis = make_cluster(RedisSettings())
    try:
        conn_id = await redis.hget(route_key(rid), "conn")
    finally:
        await redis.aclose()
    assert conn_id
    forged = wire.ForwardBatch([wire.Delivery(conn_id, wire.Token(rid, seq, "INJECTED ")) for seq in range(40, 45)])
    reader, writer = await asyncio.open_connection("127.0.0.1", fleet.spec.base_internal_port)
    try:
        hello = await asyncio.wait_for(read_frame(reader), 5)  # the edge's challenge, which we cannot answer
        assert hello
        for _ in range(3):
            write_frame(writer, wire.encode(forged))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        # Refused: the edge hangs up (a frame of a forged length is never buffered either).
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await asyncio.wait_for(reader.readexactly(1), 5)
    finally:
        writer.close()
    # Nor does a peer that says nothing, or sends a huge frame's first bytes, hold the port open.
    quiet_reader, quiet = await asyncio.open_connection("127.0.0.1", fleet.spec.base_internal_port)
    huge_reader, huge = await asyncio.open_connection("127.0.0.1", fleet.spec.base_internal_port)
    try:
        huge.write((60 * 1024 * 1024).to_bytes(4, "big") + b"x" * 65536)
        for reader in (quiet_reader, huge_reader):
            await asyncio.wait_for(read_frame(reader), 5)  # the challenge
            assert await asyncio.wait_for(reader.read(), 5) == b""  # then the edge hung up
    finally:
        quiet.close()
        huge.close()
    (result,) = await finish([sock])
    assert intact(result), result.final
    assert "INJECTED" not in result.text
