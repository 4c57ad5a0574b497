"""The real model through the whole path: SmolLM2 on the CPU behind an edge, Kafka, a worker and a router."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from openai import AsyncOpenAI

from services.launcher.fleet import Fleet
from shared.chat_client import ChatSocket
from shared.models.spec import resolve_model
from shared.models.tokenizer import Tokenizer
from tests.conftest import start_fleet

QUESTION = "What is the capital of France?"
REPEAT = "Count: one, two, one, two, one, two, one, two,"  # greedy goes on repeating it


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


async def test_openai_sampling_controls_reach_the_model(smollm2_fleet):
    """stop, logit_bias and each penalty, from the official client, change what the real model writes."""
    tokenizer = Tokenizer.from_folder(resolve_model("smollm2").tokenizer_folder)
    async with AsyncOpenAI(base_url=f"http://127.0.0.1:{smollm2_fleet.spec.base_port}/v1", api_key="dev-key") as client:

        async def answer(question: str = QUESTION, **controls) -> tuple[str, str]:
            messages = [{"role": "user", "content": question}]
            reply = await client.chat.completions.create(
                model="smollm2", messages=messages, temperature=0, **({"max_tokens": 24} | controls)
            )
            return reply.choices[0].message.content, reply.choices[0].finish_reason

        plain, _ = await answer()
        assert "Paris" in plain
        cut, reason = await answer(stop=["Paris", "never-seen"])
        assert reason == "stop" and plain.startswith(cut) and "Paris" not in cut
        (forced,) = tokenizer.encode(" banana", add_special_tokens=False)[:1]
        biased, _ = await answer(logit_bias={str(forced): 100}, max_tokens=3)
        assert biased == tokenizer.decode([forced] * 3)
        # Penalties show on an answer that repeats itself.
        repeated, _ = await answer(REPEAT)
        assert repeated.lower().count("two") >= 5, repeated
        for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.8}):
            # repetition_penalty is vLLM's, not OpenAI's: the client sends it as an extra field.
            extra = {"extra_body": penalty} if "repetition_penalty" in penalty else penalty
            changed, _ = await answer(REPEAT, **extra)
            assert changed.lower().count("two") < repeated.lower().count("two"), (penalty, changed)


async def test_openai_logprobs_of_each_token_with_its_alternatives(smollm2_fleet):
    async with AsyncOpenAI(base_url=f"http://127.0.0.1:{smollm2_fleet.spec.base_port}/v1", api_key="dev-key") as client:
        messages = [{"role": "user", "content": QUESTION}]
        reply = await client.chat.completions.create(
            model="smollm2", messages=messages, temperature=0, max_tokens=16, logprobs=True, top_logprobs=3
        )
        content = reply.choices[0].logprobs.content
        assert "".join(t.token for t in content) == reply.choices[0].message.content
        for t in content:
            assert len(t.top_logprobs) == 3 and t.logprob <= 0 and t.bytes == list(t.token.encode())
            assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the likeliest
            assert sum(math.exp(top.logprob) for top in t.top_logprobs) <= 1 + 1e-4
        stream = await client.chat.completions.create(
            model="smollm2", messages=messages, temperature=0, max_tokens=16, logprobs=True, stream=True
        )
        streamed = [t for chunk in [c async for c in stream] if chunk.choices and chunk.choices[0].logprobs
                    for t in chunk.choices[0].logprobs.content]  # fmt: skip
        assert [t.token for t in streamed] == [t.token for t in content]
        # The second request's prompt comes from the prefix cache, its last positions attended in two parts
        # merged by log-sum-exps: the same tokens, logprobs equal to float32's rounding only.
        assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-3)
        assert all(t.top_logprobs == [] for t in streamed)  # logprobs alone: no alternatives
        plain = await client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=4)
        assert plain.choices[0].logprobs is None
