"""Structured outputs and tool calls through the whole path, with the official client: SmolLM2 on the
CPU keeps to a JSON schema, a regex and a choice and makes a forced call in a two-turn conversation;
the echo model's replies show how `auto` replies are read for calls, whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest
from openai import AsyncOpenAI

from services.launcher.fleet import Fleet
from tests.conftest import start_fleet
from tests.integration.conftest import WEATHER

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="class")  # one fleet at a time on the test ports: each lives for its class
def smollm2_fleet(topics, fleet_logs) -> Iterator[Fleet]:
    fleet = start_fleet(topics, fleet_logs, edges=1, routers=1, workers=1, model="smollm2")
    yield fleet
    fleet.stop()


@pytest.fixture(scope="class")
def echo_fleet(topics, fleet_logs) -> Iterator[Fleet]:
    fleet = start_fleet(topics, fleet_logs, edges=1, routers=1, workers=1)
    yield fleet
    fleet.stop()


def client_of(fleet: Fleet) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://127.0.0.1:{fleet.spec.base_port}/v1", api_key="dev-key", max_retries=0, timeout=300)


class TestOnSmolLM2:
    async def test_json_schema_regex_and_choice_constrain_the_real_model(self, smollm2_fleet):
        async with client_of(smollm2_fleet) as client:
            ask = [{"role": "user", "content": "Describe a person."}]
            fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
            reply = await client.chat.completions.create(
                model="smollm2", messages=ask, temperature=0.9, seed=5, max_tokens=60, response_format=fmt
            )
            jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
            assert reply.choices[0].finish_reason == "stop"
            anything = await client.chat.completions.create(
                model="smollm2", messages=ask, temperature=0, max_tokens=80, response_format={"type": "json_object"}
            )
            if anything.choices[0].finish_reason == "stop":
                assert isinstance(json.loads(anything.choices[0].message.content), dict)
            date = await client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "A date?"}], temperature=0.7, max_tokens=20,
                extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
            )  # fmt: skip
            text = date.choices[0].message.content
            assert len(text) == 10 and text.startswith("20") and text[4] == "-" == text[7], text
            picked = await client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=5,
                extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
            )  # fmt: skip
            assert picked.choices[0].message.content in ("yes", "no")


    async def test_two_turn_tool_conversation_with_a_forced_call(self, smollm2_fleet):
        async with client_of(smollm2_fleet) as client:
            messages = [{"role": "user", "content": "What is the weather in Paris?"}]
            first = await client.chat.completions.create(
                model="smollm2", messages=messages, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                temperature=0, max_tokens=100,
            )
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})},
            ]
            named = {"type": "function", "function": {"name": "get_weather"}}
            again = await client.chat.completions.create(
                model="smollm2", messages=messages, tools=[WEATHER], tool_choice=named, temperature=0, max_tokens=100,
                stream=True,
            )  # fmt: skip
            chunks = [chunk async for chunk in again]
            calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            assert calls[0].function.name == "get_weather"
            json.loads("".join(tc.function.arguments or "" for tc in calls))
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            answer = await client.chat.completions.create(
                model="smollm2", messages=messages, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=30
            )
            assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


class TestOnEcho:
    async def test_auto_replies_are_read_for_tool_calls(self, echo_fleet):
        """The echo model says back what it is told: told a call, its reply is one, whole or streamed."""
        async with client_of(echo_fleet) as client:
            messages = [{"role": "user", "content": "Checking. " + CALL}]
            reply = await client.chat.completions.create(model="echo", messages=messages, tools=[WEATHER])
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
            assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
            stream = await client.chat.completions.create(model="echo", messages=messages, tools=[WEATHER], stream=True)
            chunks = [chunk async for chunk in stream]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            assert content.strip() == "Checking." and calls[0].id and calls[0].function.name == "get_weather"
            assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Paris"}
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            plain = await client.chat.completions.create(model="echo", messages=messages)  # no tools: just text
            assert plain.choices[0].message.content.endswith("</tool_call>") and not plain.choices[0].message.tool_calls
