"""/v1/completions and /v1/responses: the official client against the real fleet (the echo model, then
SmolLM2 on the CPU), raw HTTP for bad requests.

Each fleet lives for its class only, so the two never share the test ports or the topics at once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx2
import openai
import pytest
from openai import AsyncOpenAI

from services.launcher.fleet import Fleet
from shared.chat_client import ChatSocket
from shared.models.echo import CONTEXT_PIECES
from shared.models.spec import resolve_model
from shared.models.tokenizer import Tokenizer
from tests.conftest import start_fleet

PROMPT = "Once upon a time"  # four echo pieces
LONG = " ".join(f"w{i}" for i in range(20))


def api_url(fleet: Fleet) -> str:
    return f"http://127.0.0.1:{fleet.spec.base_port}/v1"


def assert_openai_error(response: httpx2.Response, status: int, code: str | None, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == param and error["message"], error


@pytest.fixture(scope="class")
def echo_fleet(topics, fleet_logs) -> Iterator[Fleet]:
    fleet = start_fleet(topics, fleet_logs, edges=1, routers=1, workers=1, model="echo", echo_delay_ms=5)
    yield fleet
    fleet.stop()


@pytest.fixture
async def client(echo_fleet) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(api_key="dev-key", base_url=api_url(echo_fleet), max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture
async def http(echo_fleet) -> AsyncIterator[httpx2.AsyncClient]:
    headers = {"Authorization": "Bearer dev-key"}
    async with httpx2.AsyncClient(base_url=api_url(echo_fleet), headers=headers, timeout=30) as c:
        yield c


class TestEchoFleet:
    # /v1/completions ------------------------------------------------------------------------
    async def test_a_text_prompt_is_echoed_without_the_chat_template_with_exact_usage(self, client):
        completion = await client.completions.create(model="echo", prompt=PROMPT)
        assert completion.id.startswith("cmpl-") and completion.object == "text_completion"
        (choice,) = completion.choices
        assert choice.text == PROMPT and choice.finish_reason == "stop" and choice.index == 0
        usage = completion.usage
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (4, 4, 8)
        assert usage.prompt_tokens_details.cached_tokens == 0

    async def test_token_ids_echo_and_the_default_cap_is_sixteen(self, client):
        ids = await client.completions.create(model="echo", prompt=[5, 7, 9])
        assert ids.choices[0].text == "5 7 9" and ids.usage.prompt_tokens == 3
        capped = await client.completions.create(model="echo", prompt=LONG)  # no max_tokens: OpenAI's 16
        assert capped.choices[0].finish_reason == "length" and capped.usage.completion_tokens == 16
        assert capped.choices[0].text == "".join(f"w{i} " for i in range(16))

    async def test_echo_puts_the_prompt_first(self, client):
        completion = await client.completions.create(model="echo", prompt="one two three", echo=True, max_tokens=2)
        assert completion.choices[0].text == "one two threeone two " and completion.choices[0].finish_reason == "length"
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, 2)

    async def test_a_stream_with_echo_and_usage(self, client):
        stream = await client.completions.create(
            model="echo", prompt=PROMPT, echo=True, stream=True, stream_options={"include_usage": True},
            temperature=0, top_p=0.5, seed=1, stop=["never"], user="u-1",
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        *texts, last = chunks
        assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "text_completion" for c in chunks)
        assert [c.choices[0].text for c in texts] == [PROMPT, "Once ", "upon ", "a ", "time", ""]
        assert [c.choices[0].finish_reason for c in texts] == [None] * 5 + ["stop"]
        assert all(c.usage is None for c in texts)
        assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 4)

    # /v1/responses ---------------------------------------------------------------------------
    async def test_a_response_echoes_the_input_with_usage(self, client):
        response = await client.responses.create(model="echo", input=PROMPT, instructions="be brief", temperature=0)
        assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
        assert response.output_text == PROMPT and response.instructions == "be brief"
        (item,) = response.output
        assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
        usage = response.usage
        assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (6, 4, 10)  # instructions count
        assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0

    async def test_message_items_and_a_cut_answer_is_incomplete(self, client):
        items = [
            {"role": "user", "content": "first"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "first"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "one two three"}]},
        ]
        response = await client.responses.create(model="echo", input=items, max_output_tokens=2, store=False)
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.output_text == "one two " and response.usage.output_tokens == 2

    async def test_a_streamed_response_sends_openais_events(self, client):
        stream = await client.responses.create(model="echo", input=PROMPT, stream=True)
        events = [event async for event in stream]
        types = [e.type for e in events]
        assert types == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            *["response.output_text.delta"] * 4, "response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.completed",
        ]  # fmt: skip
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == PROMPT
        final = events[-1].response
        assert final.output_text == PROMPT and final.usage.input_tokens == 4 and final.usage.output_tokens == 4

    # Bad requests -----------------------------------------------------------------------------
    @pytest.mark.parametrize(
        ("path", "body", "code", "param"),
        [
            ("/completions", {"prompt": "x", "logprobs": 6}, "invalid_value", "logprobs"),
            ("/completions", {"prompt": "x", "n": 2}, "unsupported_parameter", "n"),
            ("/completions", {"prompt": "x", "bogus": 1}, "unknown_parameter", "bogus"),
            ("/completions", {"prompt": ""}, "invalid_value", "prompt"),
            ("/completions", {"prompt": ["a", "b"]}, "unsupported_parameter", "prompt"),
            ("/completions", {"prompt": "x", "max_tokens": 0}, "invalid_value", "max_tokens"),
            ("/completions", {"prompt": "w " * (CONTEXT_PIECES + 1)}, "context_length_exceeded", "prompt"),
            ("/responses", {"input": "x", "previous_response_id": "resp_1"}, "previous_response_not_found",
             "previous_response_id"),
            ("/responses", {"input": "x", "messages": []}, "unknown_parameter", "messages"),
            ("/responses", {"input": [{"role": "tool", "content": "x"}]}, "invalid_value", "input[0].role"),
            ("/responses", {"input": "w " * (CONTEXT_PIECES + 1)}, "context_length_exceeded", "input"),
            ("/responses", {"input": "x", "model": "gpt-4o"}, "model_not_found", "model"),
        ],
    )  # fmt: skip
    async def test_bad_requests_are_400_naming_the_parameter(self, http, path, body, code, param):
        assert_openai_error(await http.post(path, json={"model": "echo", **body}), 400, code, param)

    async def test_no_key_and_not_json(self, http, echo_fleet):
        for path in ("/completions", "/responses"):
            anonymous = await httpx2.AsyncClient(base_url=api_url(echo_fleet)).post(path, json={})
            assert_openai_error(anonymous, 401, "invalid_api_key", None)
            garbled = await http.post(path, content=b"{", headers={"content-type": "application/json"})
            assert_openai_error(garbled, 400, "invalid_json", None)

    async def test_the_client_raises_on_a_refused_parameter(self, client):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model="echo", prompt="x", logprobs=2, echo=True)
        assert caught.value.body["param"] == "logprobs"

    async def test_the_websocket_protocol_takes_a_raw_prompt(self, echo_fleet):
        sock = await ChatSocket.open(echo_fleet.spec.chat_url(0))
        try:
            await sock.send({"type": "chat", "id": "p1", "prompt": [4, 2]})
            result = await sock.collect("p1", timeout=30)
        finally:
            await sock.close()
        assert result.text == "4 2" and result.final["usage"]["prompt_tokens"] == 2


QUESTION = "What is the capital of France?"
# Over one 16-token KV block, so its second run comes from the prefix cache; greedy goes on with "Berlin".
OPENING = "The capital of France is Paris. The capital of Italy is Rome. The capital of Germany is"


@pytest.fixture(scope="class")
def smollm2_fleet(topics, fleet_logs) -> Iterator[Fleet]:
    fleet = start_fleet(topics, fleet_logs, edges=1, routers=1, workers=1, model="smollm2")
    yield fleet
    fleet.stop()


@pytest.fixture
async def smollm2(smollm2_fleet) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(api_key="dev-key", base_url=api_url(smollm2_fleet), max_retries=0, timeout=120) as c:
        yield c


class TestSmolLM2:
    async def test_a_completion_continues_the_raw_text(self, smollm2):
        tokenizer = Tokenizer.from_folder(resolve_model("smollm2").tokenizer_folder)
        completion = await smollm2.completions.create(model="smollm2", prompt=OPENING, max_tokens=8, temperature=0)
        text = completion.choices[0].text
        assert "Berlin" in text, text
        assert completion.usage.prompt_tokens == len(tokenizer.encode(OPENING))  # no template around it
        stream = await smollm2.completions.create(
            model="smollm2", prompt=tokenizer.encode(OPENING), max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text  # the same ids, the same answer
        assert chunks[-1].usage.prompt_tokens == completion.usage.prompt_tokens
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16  # the same prompt, from the prefix cache

    async def test_a_response_answers_and_streams_the_same(self, smollm2):
        response = await smollm2.responses.create(
            model="smollm2", input=QUESTION, max_output_tokens=32, temperature=0
        )
        assert "Paris" in response.output_text, response.output_text
        assert response.usage.input_tokens > 20  # the chat template's tokens around the question
        stream = await smollm2.responses.create(
            model="smollm2", input=QUESTION, max_output_tokens=32, temperature=0, stream=True
        )
        events = [event async for event in stream]
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.output_text == response.output_text
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
