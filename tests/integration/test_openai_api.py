"""The OpenAI-compatible HTTP API: the official client against the real fleet (echo model), raw HTTP for bad input.

A scripted stand-in for EdgeService covers what the fleet cannot be made to do on cue
(refusals under load, a worker failing mid-stream).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx2
import openai
import pytest
from openai import AsyncOpenAI
from starlette.applications import Starlette

from services.edge.connection import Connection
from services.edge.openai_api import openai_routes
from services.edge.openai_schema import refusal_error
from services.edge.protocol import AcceptedFrame, ChatFrame, ProtocolError
from services.edge.settings import EdgeSettings
from services.edge.tenant_directory import TenantDirectory
from shared import wire
from shared.codes import ErrorCode, FinishReason
from shared.models.echo import CONTEXT_PIECES
from tests.conftest import KafkaTap

HELLO = "Hello there, streaming world!"  # four echo pieces
USER = [{"role": "user", "content": HELLO}]
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objx"}}}  # no such type


def api_url(fleet, edge: int = 0) -> str:
    return f"http://127.0.0.1:{fleet.spec.base_port + edge}/v1"


@pytest.fixture
async def client(echo_fleet) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(api_key="dev-key", base_url=api_url(echo_fleet), max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture
async def http(echo_fleet) -> AsyncIterator[httpx2.AsyncClient]:
    headers = {"Authorization": "Bearer dev-key"}
    async with httpx2.AsyncClient(base_url=api_url(echo_fleet, 1), headers=headers, timeout=30) as c:
        yield c


def assert_openai_error(response: httpx2.Response, status: int, code: str | None, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code and error["param"] == param


# Completions through the fleet ------------------------------------------------------------
async def test_non_streaming_completion_echoes_with_usage(client):
    completion = await client.chat.completions.create(model="echo", messages=USER)
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    assert completion.model == "echo" and len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == HELLO
    assert choice.finish_reason == "stop"
    assert completion.usage.prompt_tokens == 4 and completion.usage.completion_tokens == 4
    assert completion.usage.total_tokens == 8 and completion.usage.prompt_tokens_details.cached_tokens == 0


async def test_streaming_completion_streams_the_echo_in_order(client):
    stream = await client.chat.completions.create(model="echo", messages=USER, stream=True)
    chunks = [chunk async for chunk in stream]
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].delta.content for c in chunks[1:-1]] == ["Hello ", "there, ", "streaming ", "world!"]
    assert [c.choices[0].finish_reason for c in chunks] == [None] * 5 + ["stop"]
    assert all(c.usage is None for c in chunks)


async def test_include_usage_ends_with_a_usage_chunk(client):
    prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one two three"}]
    stream = await client.chat.completions.create(
        model="echo", messages=prompt, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three"
    *body, last = chunks
    assert all(c.usage is None for c in body) and body[-1].choices[0].finish_reason == "stop"
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (5, 3, 8)
    assert last.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("limit", ["max_tokens", "max_completion_tokens"])
async def test_token_limit_cuts_with_length(client, limit):
    completion = await client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "one two three four five"}], **{limit: 2}
    )
    assert completion.choices[0].message.content == "one two "
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 2


async def test_harmless_openai_fields_and_content_parts_are_accepted(client):
    messages = [
        {"role": "developer", "content": "you echo"},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": t} for t in ("first", "part")]},
    ]
    completion = await client.chat.completions.create(
        model="echo", messages=messages, user="u-1", n=1, presence_penalty=0, frequency_penalty=0.0, temperature=0,
        top_p=0.5, seed=3, logprobs=False, store=False, metadata={"k": "v"}, response_format={"type": "text"},
    )
    assert completion.choices[0].message.content == "first\npart"


async def test_models_list_and_retrieve(client):
    models = await client.models.list()
    assert [m.id for m in models.data] == ["echo"] and models.data[0].object == "model"
    assert (await client.models.retrieve("echo")).id == "echo"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-nope")


# Refusals through the fleet ----------------------------------------------------------------
async def test_unknown_key_is_401_for_the_client(echo_fleet):
    async with AsyncOpenAI(api_key="wrong-key", base_url=api_url(echo_fleet), max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as info:
            await wrong.chat.completions.create(model="echo", messages=USER)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


@pytest.mark.parametrize("path", ["/chat/completions", "/models"])
async def test_missing_key_is_401_with_openai_shape(echo_fleet, path):
    async with httpx2.AsyncClient(base_url=api_url(echo_fleet), timeout=30) as anonymous:
        response = await (anonymous.post(path, json={}) if path.startswith("/chat") else anonymous.get(path))
    assert_openai_error(response, 401, "invalid_api_key")
    assert response.headers["www-authenticate"] == "Bearer"


def body(**fields: object) -> dict:
    return {"model": "echo", "messages": USER} | fields


@pytest.mark.parametrize(
    "payload, code, param",
    [
        (b"{oops", "invalid_json", None),
        (json.dumps(body(model="gpt-4o")).encode(), "model_not_found", "model"),
        (json.dumps(body(n=2)).encode(), "unsupported_parameter", "n"),
        (json.dumps({"model": "echo"}).encode(), "invalid_value", "messages"),
        (json.dumps(body(messages=[])).encode(), "invalid_value", "messages"),
        (json.dumps(body(messages=[{"role": "robot", "content": "x"}])).encode(), "invalid_value", "messages[0].role"),
        (json.dumps(body(max_tokens=0)).encode(), "invalid_value", "max_tokens"),
        (json.dumps(body(temperature="hot")).encode(), "invalid_value", "temperature"),
        (json.dumps(body(frobnicate=True)).encode(), "unknown_parameter", "frobnicate"),
        (json.dumps(body(presence_penalty=2.5)).encode(), "invalid_value", "presence_penalty"),
        (json.dumps(body(logit_bias={"ab": 1})).encode(), "invalid_value", "logit_bias"),
        (json.dumps(body(logit_bias={"5": 101})).encode(), "invalid_value", "logit_bias"),
        (json.dumps(body(stop=[""])).encode(), "invalid_value", "stop[0]"),
        (json.dumps(body(top_logprobs=3)).encode(), "invalid_value", "top_logprobs"),
        (json.dumps(body(logprobs=True, top_logprobs=21)).encode(), "invalid_value", "top_logprobs"),
        (json.dumps(body(tools=[{"type": "function"}])).encode(), "invalid_value", "tools[0].function"),
        (json.dumps(body(functions=[{"name": "f"}])).encode(), "unsupported_parameter", "functions"),
        (json.dumps(body(response_format=BAD_SCHEMA)).encode(), "invalid_schema", "response_format"),
        (json.dumps(body(structured_outputs={"regex": "[a-"})).encode(), "invalid_schema", "response_format"),
        (json.dumps(body(tool_choice="required")).encode(), "invalid_schema", "tool_choice"),
        (json.dumps(body(stream_options={"include_usage": True})).encode(), "invalid_value", "stream_options"),
        (b"[1, 2]", "invalid_value", None),
    ],
)
async def test_bad_request_is_400_with_openai_shape(http, payload, code, param):
    response = await http.post("/chat/completions", content=payload, headers={"Content-Type": "application/json"})
    assert_openai_error(response, 400, code, param)


async def test_wrong_content_type_is_400(http):
    response = await http.post("/chat/completions", content=json.dumps(body()), headers={"Content-Type": "text/plain"})
    assert_openai_error(response, 400, "invalid_content_type")


async def test_body_over_the_frame_limit_is_413(http):
    huge = body(messages=[{"role": "user", "content": "x" * (1024 * 1024 + 1)}])
    response = await http.post("/chat/completions", json=huge)
    assert_openai_error(response, 413, "request_too_large")
    assert (await http.post("/chat/completions", json=body())).status_code == 200  # the edge serves on


async def test_prompt_over_the_context_is_400_context_length_exceeded(http):
    long_prompt = body(messages=[{"role": "user", "content": "w " * (CONTEXT_PIECES + 1)}])
    response = await http.post("/chat/completions", json=long_prompt)
    assert_openai_error(response, 400, "context_length_exceeded", "messages")


# A client going away frees the worker -----------------------------------------------------
def cancelled_done(request_id: str | None = None, prompt_tokens: int | None = None):
    def match(event: wire.Event) -> bool:
        if not isinstance(event, wire.Done) or event.finish_reason != "cancelled":
            return False
        return event.request_id == request_id if request_id else event.usage.prompt_tokens == prompt_tokens
    return match


async def test_sse_client_disconnect_cancels_on_the_worker(http, topics, infra):
    async with KafkaTap(infra, topics.tokens, topics.tokens_partitions) as tap:
        request = body(messages=[{"role": "user", "content": " ".join(["word"] * 2000)}], stream=True)
        async with http.stream("POST", "/chat/completions", json=request) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            request_id = response.headers["x-request-id"]
            lines = response.aiter_lines()
            while '"content":"word ' not in await anext(lines):  # a token arrived: it is running
                pass
        # Leaving the block closed the HTTP connection mid-stream.
        events = await tap.events_until(cancelled_done(request_id), timeout=10)
    assert events[-1].usage.completion_tokens < 2000


async def test_non_streaming_client_disconnect_cancels_on_the_worker(http, topics, infra):
    async with KafkaTap(infra, topics.tokens, topics.tokens_partitions) as tap:
        request = body(messages=[{"role": "user", "content": " ".join(["wait"] * 1999)}])
        with pytest.raises(httpx2.ReadTimeout):
            await http.post("/chat/completions", json=request, timeout=1.0)  # 1999 steps of 5 ms outlast this
        events = await tap.events_until(cancelled_done(prompt_tokens=1999), timeout=10)
    assert events[-1].usage.completion_tokens < 1999


# Error mapping against a scripted service ----------------------------------------------------
class ScriptedService:
    """Stands in for EdgeService: refuses with `refusal`, or delivers `script(request_id)` to the chat."""

    def __init__(self, refusal: ProtocolError | None = None, script=lambda rid: []) -> None:
        self.settings = EdgeSettings(model="echo", api_keys="k:t")
        self.tenants = TenantDirectory(None, self.settings.api_keys, "")
        self._refusal = refusal
        self._script = script
        self.closed_unfinished: list[list[str]] = []
        self.refusals: list[tuple[str, str | None]] = []

    def open_connection(self, conn: Connection) -> None:
        pass

    def count_refusal(self, code: str, tenant: str | None) -> None:
        self.refusals.append((code, tenant))

    async def close_connection(self, conn: Connection, grace: bool = True) -> None:
        assert not grace, "an HTTP client cannot resume, so nothing may wait for it"
        self.closed_unfinished.append(conn.request_ids())

    async def start_chat(self, conn: Connection, frame: ChatFrame) -> None:
        if self._refusal is not None:
            raise self._refusal
        conn.open_chat(frame.id, "r1")
        conn.send(AcceptedFrame(frame.id, "r1", "resume-token"))
        for event in self._script("r1"):
            conn.deliver(event)


def scripted_client(service: ScriptedService) -> httpx2.AsyncClient:
    app = Starlette(routes=openai_routes(service))  # type: ignore[arg-type]
    transport = httpx2.ASGITransport(app=app)
    return httpx2.AsyncClient(transport=transport, base_url="http://edge/v1", headers={"Authorization": "Bearer k"})


@pytest.mark.parametrize(
    "refusal, status, code",
    [
        (ProtocolError(ErrorCode.TOO_MANY_CHATS, "at most 64", "c"), 429, "too_many_chats"),
        (ProtocolError(ErrorCode.UNAVAILABLE, "retry", "c"), 503, "unavailable"),
        (ProtocolError(ErrorCode.ENGINE_ERROR, "a refusal with no status of its own", "c"), 500, "engine_error"),
        (ProtocolError(ErrorCode.PROMPT_TOO_LONG, "too long", "c"), 400, "context_length_exceeded"),
    ],
)
async def test_admission_refusals_map_to_http_status(refusal, status, code):
    service = ScriptedService(refusal=refusal)
    async with scripted_client(service) as http:
        response = await http.post("/chat/completions", json=body(stream=True))
    assert_openai_error(response, status, code, "messages" if code == "context_length_exceeded" else None)
    assert response.headers.get("retry-after") == ("1" if status in (429, 503) else None)
    assert service.closed_unfinished == [[]]  # the refused chat's connection was closed too
    assert service.refusals == [(refusal.code, "t")]  # and the refusal is counted for its tenant


def test_every_retryable_code_asks_the_client_to_come_back_later():
    for code in ErrorCode:
        error = refusal_error(code, "x")
        assert (error.status in (429, 503) and error.retry_after == 1) == code.retryable, code


async def test_worker_error_before_any_token_is_an_http_status():
    service = ScriptedService(script=lambda rid: [wire.Error(rid, 0, ErrorCode.WORKER_LOST, "worker died", True)])
    async with scripted_client(service) as http:
        response = await http.post("/chat/completions", json=body(stream=True))
    assert_openai_error(response, 503, "worker_lost")


async def test_worker_error_mid_stream_is_an_sse_error_event_without_done():
    def script(rid: str) -> list[wire.Event]:
        return [wire.Token(rid, 0, "Hel"), wire.Error(rid, 1, ErrorCode.WORKER_LOST, "worker died", True)]

    async with scripted_client(ScriptedService(script=script)) as http:
        response = await http.post("/chat/completions", json=body(stream=True))
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
        client = AsyncOpenAI(api_key="k", base_url="http://edge/v1", http_client=http, max_retries=0)
        stream = await client.chat.completions.create(model="echo", messages=USER, stream=True)
        with pytest.raises(openai.APIError, match="worker died"):
            async for _ in stream:
                pass
    assert json.loads(events[1])["choices"][0]["delta"] == {"content": "Hel"}
    assert json.loads(events[-1])["error"]["code"] == "worker_lost" and "[DONE]" not in events


async def test_cancelled_finish_reads_as_stop():
    usage = wire.Usage(prompt_tokens=4, cached_tokens=1, completion_tokens=1)

    def script(rid: str) -> list[wire.Event]:
        return [wire.Token(rid, 0, "Hel"), wire.Done(rid, 1, FinishReason.CANCELLED, usage)]

    async with scripted_client(ScriptedService(script=script)) as http:
        response = await http.post("/chat/completions", json=body())
    choice, usage_body = response.json()["choices"][0], response.json()["usage"]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "Hel"
    assert usage_body == {
        "prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 1}
    }
