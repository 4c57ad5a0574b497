"""The real model through the whole path: SmolLM2 on the CPU behind an edge, Kafka, a worker and a router."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import AsyncOpenAI

from services.launcher.fleet import Fleet
from shared.chat_client import ChatSocket
from tests.conftest import start_fleet

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm2_fleet(topics, fleet_logs) -> Iterator[Fleet]:
    fleet = start_fleet(topics, fleet_logs, edges=1, routers=1, workers=1, model="smollm2")
    yield fleet
    fleet.stop()


async def test_a_sensible_answer_streams_and_the_prefix_is_reused(smollm2_fleet):
    sock = await ChatSocket.open(smollm2_fleet.spec.chat_url(0))
    try:
        await sock.chat("q1", QUESTION, temperature=0, max_tokens=32)
        first = await sock.collect("q1", timeout=120)
        await sock.chat("q2", QUESTION, temperature=0, max_tokens=32)
        second = await sock.collect("q2", timeout=120)
    finally:
        await sock.close()
    assert "Paris" in first.text, first.text
    assert first.final["type"] == "done" and first.final["finish_reason"] == "stop"
    usage = first.final["usage"]
    assert usage["completion_tokens"] >= len(first.tokens) > 1 and usage["prompt_tokens"] > 20  # EOS counts, unseen
    # Greedy: the same question, the same answer; its prompt now comes from the prefix cache.
    assert second.text == first.text
    assert second.final["usage"]["cached_tokens"] >= 16


async def test_openai_client_gets_the_same_answer(smollm2_fleet):
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{smollm2_fleet.spec.base_port}/v1", api_key="dev-key")
    reply = await client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=32
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.prompt_tokens_details.cached_tokens >= 16
