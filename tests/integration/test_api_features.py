"""Completions `logprobs`, stored responses (`previous_response_id`) across edges and tenants, tool calls
over the WebSocket, and the tool listing in the edge's prompt-length check: the official client and the
chat socket against real fleets (the echo model on two edges, then SmolLM2 on the CPU).

Each fleet lives for its class only, so the two never share the test ports or the topics at once.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from itertools import accumulate

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

from services.launcher.fleet import Fleet
from shared.chat_client import ChatSocket
from shared.models.echo import CONTEXT_PIECES
from tests.conftest import start_fleet
from tests.integration.conftest import WEATHER

OTHER_KEY, OTHER_TENANT = f"key-{uuid.uuid4().hex}", f"other-{uuid.uuid4().hex[:8]}"
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LONG_TOOL = {"type": "function", "function": {"name": "lookup", "description": "Looks things up. " * 200}}


def client_of(fleet: Fleet, edge: int = 0, key: str = "dev-key") -> AsyncOpenAI:
    base_url = f"http://127.0.0.1:{fleet.spec.base_port + edge}/v1"
    return AsyncOpenAI(api_key=key, base_url=base_url, max_retries=0, timeout=300)


async def ws_chat(fleet: Fleet, chat_id: str, messages: list, edge: int = 0, **fields) -> tuple[str, dict]:
    """One chat over the WebSocket: its text and its last frame (done or error)."""
    sock = await ChatSocket.open(fleet.spec.chat_url(edge))
    try:
        await sock.send({"type": "chat", "id": chat_id, "messages": messages, **fields})
        result = await sock.collect(chat_id, timeout=300)
    finally:
        await sock.close()
    return result.text, result.final


@pytest.fixture(scope="class")
def echo_fleet(topics, fleet_logs) -> Iterator[Fleet]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRIVETRAIN_API_KEYS", f"dev-key:dev,{OTHER_KEY}:{OTHER_TENANT}")
        fleet = start_fleet(topics, fleet_logs, edges=2, routers=1, workers=1, model="echo", echo_delay_ms=5)
    yield fleet
    fleet.stop()


class TestEchoFleet:
    # /v1/completions logprobs -----------------------------------------------------------------
    async def test_completion_logprobs_whole_and_streamed(self, echo_fleet):
        """The echo model is certain of each piece (logprob 0): tokens and offsets are exact."""
        async with client_of(echo_fleet) as client:
            completion = await client.completions.create(model="echo", prompt="Once upon a time", logprobs=2)
            choice = completion.choices[0]
            logprobs = choice.logprobs
            assert logprobs.tokens == ["Once ", "upon ", "a ", "time"] and "".join(logprobs.tokens) == choice.text
            assert logprobs.token_logprobs == [0.0] * 4 and logprobs.text_offset == [0, 5, 10, 12]
            assert logprobs.top_logprobs == [{t: 0.0} for t in logprobs.tokens]
            stream = await client.completions.create(model="echo", prompt="Once upon a time", logprobs=0, stream=True)
            chunks = [c async for c in stream]
            parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
            assert [t for p in parts for t in p.tokens] == logprobs.tokens
            assert [o for p in parts for o in p.text_offset] == logprobs.text_offset  # offsets run on across chunks
            assert all(top == {} for p in parts for top in p.top_logprobs)  # 0: no alternatives
            plain = await client.completions.create(model="echo", prompt="Once upon")
            assert plain.choices[0].logprobs is None
            with pytest.raises(openai.BadRequestError) as caught:
                await client.completions.create(model="echo", prompt="x", logprobs=6)
            assert (caught.value.code, caught.value.param) == ("invalid_value", "logprobs")

    # /v1/responses previous_response_id ---------------------------------------------------------
    async def test_a_conversation_continues_on_another_edge(self, echo_fleet):
        """The echo model counts its whole prompt: the earlier turns come along, their instructions do not."""
        async with client_of(echo_fleet, 0) as first_edge, client_of(echo_fleet, 1) as second_edge:
            first = await first_edge.responses.create(model="echo", input="one two", instructions="be brief")
            assert first.usage.input_tokens == 4 and first.to_dict()["store"] is True
            second = await second_edge.responses.create(model="echo", input="three", previous_response_id=first.id)
            assert second.output_text == "three" and second.previous_response_id == first.id
            assert second.usage.input_tokens == 2 + 2 + 1  # "one two", its answer, "three"
            stream = await first_edge.responses.create(
                model="echo", input="four", previous_response_id=second.id, stream=True
            )
            final = [e async for e in stream][-1].response
            assert final.output_text == "four" and final.usage.input_tokens == 5 + 1 + 1
            after_stream = await second_edge.responses.create(model="echo", input="five", previous_response_id=final.id)
            assert after_stream.usage.input_tokens == 7 + 1 + 1  # a streamed answer is stored too

    async def test_unknown_unstored_and_other_tenants_ids_are_not_found(self, echo_fleet):
        async with client_of(echo_fleet) as mine, client_of(echo_fleet, 1, OTHER_KEY) as theirs:
            kept = await mine.responses.create(model="echo", input="secret")
            unstored = await mine.responses.create(model="echo", input="x", store=False)
            assert unstored.to_dict()["store"] is False
            for client, response_id in ((theirs, kept.id), (mine, unstored.id), (mine, f"resp_{'0' * 32}")):
                with pytest.raises(openai.BadRequestError) as caught:
                    await client.responses.create(model="echo", input="x", previous_response_id=response_id)
                assert (caught.value.code, caught.value.param) == ("previous_response_not_found", "previous_response_id")
            again = await mine.responses.create(model="echo", input="more", previous_response_id=kept.id)
            assert again.usage.input_tokens == 1 + 1 + 1  # its owner still continues it

    # Tool calls over the WebSocket --------------------------------------------------------------
    async def test_the_done_frame_carries_the_calls_and_they_go_back_as_a_turn(self, echo_fleet):
        """The echo model says back what it is told: told a call, its reply is one."""
        ask = [{"role": "user", "content": "Checking. " + CALL}]
        text, done = await ws_chat(echo_fleet, "t1", ask, tools=[WEATHER], tool_choice=NAMED)
        assert text == "Checking. " + CALL  # the tokens are the model's text, as ever
        assert done["type"] == "done" and done["content"] == "Checking."
        (call,) = done["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        follow_up = [*ask, {"role": "assistant", "content": done["content"], "tool_calls": [call]},
                     {"role": "tool", "content": '{"sky": "sunny"}', "tool_call_id": call["id"]},
                     {"role": "user", "content": "Thanks"}]  # fmt: skip
        text, done = await ws_chat(echo_fleet, "t2", follow_up, edge=1, tools=[WEATHER])
        assert text == "Thanks" and done["tool_calls"] == [] and "content" not in done
        for fields in ({}, {"tools": [WEATHER], "tool_choice": "none"}):  # not read for calls: the done of old
            _, done = await ws_chat(echo_fleet, "t3", ask, **fields)
            assert done["type"] == "done" and "tool_calls" not in done

    # The tool listing in the prompt-length check --------------------------------------------------
    async def test_a_long_tool_listing_is_refused_at_the_edge(self, echo_fleet):
        words = CONTEXT_PIECES - 200
        messages = [{"role": "user", "content": "w " * words}]
        async with client_of(echo_fleet) as client:
            fits = await client.chat.completions.create(model="echo", messages=messages, max_tokens=1)
            assert fits.usage.prompt_tokens == words
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="echo", messages=messages, tools=[LONG_TOOL], max_tokens=1)
            assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "messages")
            assert "the model's context holds 8192" in caught.value.message  # the edge's words, not the worker's
        _, refused = await ws_chat(echo_fleet, "long", messages, tools=[LONG_TOOL], max_tokens=1)
        assert refused["type"] == "error" and refused["code"] == "prompt_too_long"


@pytest.fixture(scope="class")
def smollm2_fleet(topics, fleet_logs) -> Iterator[Fleet]:
    fleet = start_fleet(topics, fleet_logs, edges=1, routers=1, workers=1, model="smollm2")
    yield fleet
    fleet.stop()


OPENING = "The capital of France is Paris. The capital of Italy is Rome. The capital of Germany is"


class TestSmolLM2:
    async def test_completion_logprobs_of_the_real_model(self, smollm2_fleet):
        async with client_of(smollm2_fleet) as client:
            ask = {"model": "smollm2", "prompt": OPENING, "max_tokens": 8, "temperature": 0, "logprobs": 2}
            completion = await client.completions.create(**ask)
            choice = completion.choices[0]
            logprobs = choice.logprobs
            assert "Berlin" in choice.text and "".join(logprobs.tokens) == choice.text
            assert logprobs.text_offset == [0, *accumulate(len(t) for t in logprobs.tokens[:-1])]
            for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
                assert logprob <= 0 and 1 <= len(top) <= 2
                assert top[token] == logprob == max(top.values())  # greedy: the chosen token is the likeliest
            stream = await client.completions.create(**ask, stream=True)
            parts = [c.choices[0].logprobs async for c in stream if c.choices and c.choices[0].logprobs]
            streamed = [(t, lp) for p in parts for t, lp in zip(p.tokens, p.token_logprobs, strict=True)]
            assert [t for t, _ in streamed] == logprobs.tokens
            # The second request reads the first one's prompt from the prefix cache, so its prompt's last
            # positions attend to a cached part and their own apart (merged by log-sum-exps), where the
            # first attended in one call: the same tokens, logprobs equal to float32's rounding only.
            assert [lp for _, lp in streamed] == pytest.approx(logprobs.token_logprobs, abs=1e-3)

    async def test_a_forced_call_over_the_websocket(self, smollm2_fleet):
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        _, done = await ws_chat(smollm2_fleet, "w1", ask, tools=[WEATHER], tool_choice=NAMED, temperature=0,
                                max_tokens=100)  # fmt: skip
        assert done["type"] == "done", done
        (call,) = done["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
