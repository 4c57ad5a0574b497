"""Bad input gets a clear error and loses nothing, against the real fleet (echo model)."""

from __future__ import annotations

import json

import pytest
from aiokafka import AIOKafkaProducer
from websockets.exceptions import InvalidStatus

from shared import wire
from shared.chat_client import ChatSocket
from shared.models.echo import CONTEXT_PIECES
from tests.conftest import KafkaTap


async def still_serves(sock: ChatSocket, chat_id: str = "after") -> None:
    await sock.chat(chat_id, "still here")
    result = await sock.collect(chat_id)
    assert result.text == "still here" and result.final["type"] == "done"


@pytest.mark.parametrize("api_key", [None, "wrong-key"])
async def test_missing_or_unknown_key_is_refused_with_401(echo_fleet, api_key):
    with pytest.raises(InvalidStatus) as info:
        await ChatSocket.open(echo_fleet.spec.chat_url(0), api_key=api_key)
    assert info.value.response.status_code == 401


async def test_key_in_query_parameter_is_accepted(echo_fleet):
    sock = await ChatSocket.open(echo_fleet.spec.chat_url(0) + "?api_key=dev-key", api_key=None)
    try:
        await still_serves(sock)
    finally:
        await sock.close()


@pytest.mark.parametrize(
    "frame, code, chat_id",
    [
        ("{oops", "invalid_json", None),
        ('{"type":"shout","id":"x1"}', "unknown_type", "x1"),
        ('{"type":"chat","id":"x2"}', "invalid_message", "x2"),
        ('{"type":"chat","id":"x3","messages":[]}', "invalid_message", "x3"),
        ('{"type":"chat","id":"x4","messages":[{"role":"user","content":"a"}],"max_tokens":0}', "invalid_message", "x4"),
        ('{"type":"cancel","id":"nope"}', "unknown_id", "nope"),
    ],
)
async def test_bad_frames_get_error_and_socket_stays_usable(echo_fleet, frame, code, chat_id):
    sock = await ChatSocket.open(echo_fleet.spec.chat_url(0))
    try:
        await sock.send(frame)
        error = await sock.next_frame(chat_id, timeout=10)
        assert error["type"] == "error" and error["code"] == code and error["message"]
        assert error["retryable"] is False
        await still_serves(sock)
    finally:
        await sock.close()


async def test_reused_in_flight_id_is_refused(echo_fleet):
    sock = await ChatSocket.open(echo_fleet.spec.chat_url(1))
    try:
        await sock.chat("dup", " ".join(["w"] * 200))
        assert (await sock.next_frame("dup"))["type"] == "accepted"
        await sock.chat("dup", "again")
        frames = []
        while not any(f["type"] == "error" for f in frames):
            frames.append(await sock.next_frame("dup"))
        assert frames[-1]["code"] == "duplicate_id"
        result = await sock.collect("dup")  # the first chat goes on untouched
        tokens = [f for f in frames if f["type"] == "token"] + result.tokens
        assert [f["seq"] for f in tokens] == list(range(200))
        await still_serves(sock)
    finally:
        await sock.close()


async def test_oversized_frame_closes_with_1009(echo_fleet):
    sock = await ChatSocket.open(echo_fleet.spec.chat_url(0))
    await sock.chat("big", "x" * (1024 * 1024 + 1))
    closed = await sock.next_frame("big", timeout=10)
    assert closed["type"] == "closed" and sock.close_code == 1009
    await sock.close()


async def test_prompt_too_long_never_reaches_kafka(echo_fleet, topics, infra):
    async with KafkaTap(infra, topics.requests, topics.requests_partitions) as tap:
        sock = await ChatSocket.open(echo_fleet.spec.chat_url(0))
        try:
            await sock.chat("long", "w " * (CONTEXT_PIECES + 1))
            error = await sock.next_frame("long", timeout=10)
            assert error["type"] == "error" and error["code"] == "prompt_too_long"
            await sock.chat("short", "fits")
            accepted = await sock.next_frame("short")
            await sock.collect("short")
        finally:
            await sock.close()
        seen = [request.request_id for request in await tap.messages(wire.ChatRequest, 2.0)]
    assert seen == [accepted["request_id"]]


async def test_malformed_request_goes_to_dead_letter_and_workers_go_on(echo_fleet, topics, infra):
    async with KafkaTap(infra, topics.dead_letter, topics.dead_letter_partitions) as tap:
        producer = AIOKafkaProducer(bootstrap_servers=infra.kafka_bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(topics.requests, b"\x93not a request", key=b"poison")
            await producer.send_and_wait(topics.requests, json.dumps({"type": "chat"}).encode(), key=b"poison2")
        finally:
            await producer.stop()
        letters = []
        for _ in range(50):
            letters += [wire.decode(v, wire.DeadLetter) for v in await tap.records(0.2)]
            if len(letters) >= 2:
                break
    assert sorted(letter.payload for letter in letters) == sorted([b"\x93not a request", b'{"type": "chat"}'])
    assert all(letter.source_topic == topics.requests and letter.reason for letter in letters)
    sock = await ChatSocket.open(echo_fleet.spec.chat_url(0))
    try:
        for i in range(4):  # every worker still serves
            await still_serves(sock, f"after-{i}")
    finally:
        await sock.close()
