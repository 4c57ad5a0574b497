"""End to end through real processes, the real Kafka broker and the real Redis Cluster (echo model)."""

from __future__ import annotations

import asyncio
import random
import time

from shared import wire
from shared.chat_client import ChatSocket
from tests.conftest import RESUME_GRACE_S, KafkaTap

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + rng.choice(["", ".", "!\n"])


def assert_intact(result, expected_text: str) -> None:
    seqs = [f["seq"] for f in result.tokens]
    assert seqs == list(range(len(seqs))), f"seq gaps or repeats: {seqs}"
    assert result.text == expected_text
    assert result.final["type"] == "done", result.final


async def test_one_chat_streams_accepted_tokens_done(echo_fleet):
    sock = await ChatSocket.open(echo_fleet.spec.chat_url(0))
    try:
        await sock.chat("c1", "Hello there, streaming world!")
        result = await sock.collect("c1")
    finally:
        await sock.close()
    kinds = [f["type"] for f in result.frames]
    assert kinds[0] == "accepted" and len(result.frames[0]["request_id"]) == 32
    assert kinds[1:-1] == ["token"] * 4 and kinds[-1] == "done"
    assert [f["text"] for f in result.tokens] == ["Hello ", "there, ", "streaming ", "world!"]
    assert result.final["finish_reason"] == "stop"
    assert result.final["usage"] == {"prompt_tokens": 4, "cached_tokens": 0, "completion_tokens": 4}


async def test_max_tokens_cuts_with_length(echo_fleet):
    sock = await ChatSocket.open(echo_fleet.spec.chat_url(1))
    try:
        await sock.chat("c1", "one two three four five", max_tokens=2)
        result = await sock.collect("c1")
    finally:
        await sock.close()
    assert result.text == "one two "
    assert result.final["finish_reason"] == "length"


async def test_fifty_concurrent_chats_over_two_edges_get_their_own_text(echo_fleet):
    rng = random.Random(7)
    sockets = [await ChatSocket.open(echo_fleet.spec.chat_url(i % 2)) for i in range(10)]
    expected: dict[tuple[int, str], str] = {}
    try:
        for n in range(50):
            s, chat_id = n % 10, f"chat-{n}"
            expected[(s, chat_id)] = f"[{n}] " + sentence(rng, rng.randint(5, 30))
            await sockets[s].chat(chat_id, expected[(s, chat_id)])
        results = await asyncio.gather(*(sockets[s].collect(c) for s, c in expected))
    finally:
        await asyncio.gather(*(s.close() for s in sockets))
    for (key, text), result in zip(expected.items(), results):
        assert_intact(result, text)


async def test_cancel_ends_with_cancelled(echo_fleet):
    sock = await ChatSocket.open(echo_fleet.spec.chat_url(0))
    try:
        await sock.chat("c1", " ".join(["word"] * 2000))
        accepted = await sock.next_frame("c1")
        assert accepted["type"] == "accepted"
        await sock.next_frame("c1")  # a first token: it is running
        await sock.send({"type": "cancel", "id": "c1"})
        result = await sock.collect("c1", timeout=10)
    finally:
        await sock.close()
    assert result.final["type"] == "done" and result.final["finish_reason"] == "cancelled"
    assert len(result.tokens) < 1999


async def test_disconnect_mid_stream_makes_the_worker_drop_it(echo_fleet, topics, infra):
    async with KafkaTap(infra, topics.tokens, topics.tokens_partitions) as tap:
        sock = await ChatSocket.open(echo_fleet.spec.chat_url(1))
        await sock.chat("c1", " ".join(["word"] * 2000), max_tokens=2000)
        request_id = (await sock.next_frame("c1"))["request_id"]
        await sock.next_frame("c1")
        await sock.ws.close()  # the user closes the tab
        closed_at = time.monotonic()
        events = await tap.events_until(
            lambda e: e.request_id == request_id and isinstance(e, (wire.Done, wire.Error)), timeout=10
        )
        waited = time.monotonic() - closed_at
    mine = [e for e in events if e.request_id == request_id]
    assert isinstance(mine[-1], wire.Done) and mine[-1].finish_reason == "cancelled"
    assert mine[-1].usage.completion_tokens < 2000
    # The stream waited for the client to resume it before the worker let it go.
    assert RESUME_GRACE_S - 0.5 <= waited <= RESUME_GRACE_S + 3
