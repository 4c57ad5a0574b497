"""/v1/completions and /v1/responses, pure: request parsing into chat frames, bodies and stream events."""

from __future__ import annotations

import json

import pytest

from services.edge.openai_completions_schema import (
    DEFAULT_MAX_TOKENS,
    parse_completions_request,
)
from services.edge.openai_responses_schema import parse_responses_request
from services.edge.openai_schema import ApiError, CompletionHeader
from services.edge.openai_text_events import SseEvent, encode_events
from services.edge.protocol import ChatMessage, DoneFrame, UsageBody
from shared import wire
from shared.codes import FinishReason
from shared.models.raw_prompt import RawPrompt

HEAD = CompletionHeader("cmpl-1", 1700000000, "echo")
RESP = CompletionHeader("resp_ab", 1700000000, "echo")
DONE = DoneFrame("c", FinishReason.STOP, UsageBody(prompt_tokens=5, cached_tokens=2, completion_tokens=3))
CUT = DoneFrame("c", FinishReason.LENGTH, UsageBody(prompt_tokens=5, cached_tokens=0, completion_tokens=3))


def completions(**fields):
    return parse_completions_request(json.dumps({"model": "echo", **fields}).encode(), "echo", "c1", HEAD)


def responses(**fields):
    return parse_responses_request(json.dumps({"model": "echo", **fields}).encode(), "echo", "r1", RESP)


def refusal(parse, **fields) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(**fields)
    assert caught.value.status == 400
    return caught.value


# /v1/completions: parsing ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "wanted"),
    [("Once upon", "Once upon"), (["Once upon"], "Once upon"), ([5, 7, 9], [5, 7, 9]), ([[5, 7]], [5, 7])],
)
def test_a_prompt_becomes_a_raw_prompt_without_messages(prompt, wanted):
    parsed = completions(prompt=prompt)
    assert parsed.frame.prompt == wanted and parsed.frame.messages == []
    assert parsed.frame.prompt_input() == RawPrompt.of(wanted)


def test_completion_defaults_and_sampling_reach_the_frame():
    plain = completions(prompt="x").frame
    assert (plain.max_tokens, plain.temperature, plain.top_p, plain.seed) == (DEFAULT_MAX_TOKENS, 1.0, 1.0, None)
    frame = completions(
        prompt="x", max_tokens=7, temperature=0, top_p=0.5, seed=3, stop="END", user="u", top_k=4, n=1, best_of=1
    ).frame
    assert (frame.max_tokens, frame.temperature, frame.top_p, frame.seed) == (7, 0, 0.5, 3)
    assert frame.stop == ["END"] and frame.top_k == 4 and frame.conversation == "u"


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({}, "invalid_value", "prompt"),  # missing
        ({"prompt": ""}, "invalid_value", "prompt"),
        ({"prompt": []}, "invalid_value", "prompt"),
        ({"prompt": ["a", "b"]}, "unsupported_parameter", "prompt"),
        ({"prompt": [1, "b"]}, "invalid_value", "prompt"),
        ({"prompt": [-1]}, "invalid_value", "prompt"),
        ({"prompt": "x", "logprobs": 6}, "invalid_value", "logprobs"),  # OpenAI's limit: 5
        ({"prompt": "x", "logprobs": -1}, "invalid_value", "logprobs"),
        ({"prompt": "x", "logprobs": True}, "invalid_value", "logprobs"),
        ({"prompt": "x", "logprobs": 2, "echo": True}, "unsupported_parameter", "logprobs"),
        ({"prompt": "x", "n": 2}, "unsupported_parameter", "n"),
        ({"prompt": "x", "best_of": 3}, "unsupported_parameter", "best_of"),
        ({"prompt": "x", "suffix": "end"}, "unsupported_parameter", "suffix"),
        ({"prompt": [1, 2], "echo": True}, "unsupported_parameter", "echo"),
        ({"prompt": "x", "max_tokens": 0}, "invalid_value", "max_tokens"),
        ({"prompt": "x", "temperature": 3}, "invalid_value", "temperature"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "invalid_value", "stream_options"),
        ({"prompt": "x", "messages": []}, "unknown_parameter", "messages"),
        ({"prompt": "x", "stream_options": {"bogus": 1}, "stream": True}, "unknown_parameter", "stream_options.bogus"),
        ({"prompt": "x", "model": "gpt-4"}, "model_not_found", "model"),
    ],
)
def test_bad_completion_requests_name_the_parameter(fields, code, param):
    error = refusal(completions, **fields)
    assert (error.code, error.param) == (code, param), error.message


def test_a_refusal_quotes_a_huge_value_cut_short():
    """What was sent may be 100 kB; what is said of it stays a message's size."""
    error = refusal(completions, prompt="x", model="m" * 100_000)
    assert error.code == "model_not_found" and len(error.message) <= 1_000 and error.message.endswith("…")


# /v1/completions: bodies and chunks -----------------------------------------------------------
def test_completion_body_with_usage_and_echo():
    plain = completions(prompt="Say").renderer.body(" hi", DONE)
    assert plain["object"] == "text_completion" and plain["id"] == "cmpl-1"
    assert plain["choices"] == [{"text": " hi", "index": 0, "logprobs": None, "finish_reason": "stop"}]
    assert plain["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 2}
    }  # fmt: skip
    echoed = completions(prompt="Say", echo=True).renderer.body(" hi", CUT)
    assert echoed["choices"][0]["text"] == "Say hi" and echoed["choices"][0]["finish_reason"] == "length"


def test_completion_stream_puts_an_echoed_prompt_first_and_ends_with_usage_then_done():
    render = completions(prompt="Say", echo=True, stream=True, stream_options={"include_usage": True}).renderer
    events = [*render.opening(), *render.token(" hi"), *render.done(DONE)]
    *chunks, usage, sentinel = events
    assert sentinel == SseEvent("[DONE]") and all(e.event is None for e in events)
    assert [c.data["choices"][0]["text"] for c in chunks] == ["Say", " hi", ""]
    assert [c.data["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert all(c.data["usage"] is None for c in chunks)
    assert usage.data["choices"] == [] and usage.data["usage"]["completion_tokens"] == 3
    plain = completions(prompt="Say", stream=True).renderer
    assert plain.opening() == [] and "usage" not in plain.token("a")[0].data
    assert plain.failed(ApiError(503, "gone", code="worker_lost"))[0].data["error"]["code"] == "worker_lost"


def test_events_encode_as_server_sent_events():
    encoded = encode_events([SseEvent({"a": 1}, event="response.created"), SseEvent("[DONE]")])
    assert encoded == b'event: response.created\ndata: {"a":1}\n\ndata: [DONE]\n\n'


# /v1/responses: parsing --------------------------------------------------------------------------
def test_text_input_and_instructions_become_messages():
    frame = responses(input="Hi", instructions="be brief", max_output_tokens=9, temperature=0).frame
    assert frame.messages == [ChatMessage("system", "be brief"), ChatMessage("user", "Hi")]
    assert (frame.max_tokens, frame.temperature, frame.prompt) == (9, 0, None)


def test_message_items_with_parts_and_an_earlier_answer():
    items = [
        {"role": "developer", "content": "you echo"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "one"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "one", "annotations": []}]},
        {"role": "user", "content": "two"},
    ]  # fmt: skip
    frame = responses(input=items, store=False, metadata={"k": "v"}, text={"format": {"type": "text"}}).frame
    assert [(m.role, m.content) for m in frame.messages] == [
        ("system", "you echo"), ("user", "one"), ("assistant", "one"), ("user", "two")
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"input": "x", "previous_response_id": ""}, "invalid_value", "previous_response_id"),
        ({"input": "x", "conversation": "conv_1"}, "unsupported_parameter", "conversation"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "unsupported_parameter", "tools"),
        ({"input": "x", "text": {"format": {"type": "json_object"}}}, "unsupported_parameter", "text"),
        ({"input": "x", "background": True}, "unsupported_parameter", "background"),
        ({"input": ""}, "invalid_value", "input"),
        ({"input": []}, "invalid_value", "input"),
        ({}, "invalid_value", "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "invalid_value", "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "invalid_value",
         "input[0].content[0].type"),
        ({"input": "x", "max_tokens": 5}, "unknown_parameter", "max_tokens"),
        ({"input": "x", "max_output_tokens": 0}, "invalid_value", "max_output_tokens"),
        ({"input": "x", "stream_options": {}}, "invalid_value", "stream_options"),
    ],
)  # fmt: skip
def test_bad_responses_requests_name_the_parameter(fields, code, param):
    error = refusal(responses, **fields)
    assert (error.code, error.param) == (code, param), error.message


# /v1/responses: the object and its events ------------------------------------------------------
def test_response_object_completed_and_incomplete():
    render = responses(input="x", instructions="i", metadata={"k": "v"}).renderer
    body = render.body("hello", DONE)
    assert body["id"] == "resp_ab" and body["object"] == "response" and body["status"] == "completed"
    assert body["instructions"] == "i" and body["metadata"] == {"k": "v"} and body["incomplete_details"] is None
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["id"] == "msg_ab"
    assert item["content"] == [{"type": "output_text", "text": "hello", "annotations": [], "logprobs": []}]
    assert body["usage"] == {
        "input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8,
    }  # fmt: skip
    cut = render.body("hel", CUT)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_response_stream_events_in_openai_order():
    render = responses(input="x", stream=True).renderer
    events = [*render.opening(), *render.token("he"), *render.token("llo"), *render.done(DONE)]
    types = [e.data["type"] for e in events]
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e.event for e in events] == types and [e.data["sequence_number"] for e in events] == list(range(10))
    assert events[0].data["response"]["status"] == "in_progress" and events[0].data["response"]["usage"] is None
    assert [e.data["delta"] for e in events[4:6]] == ["he", "llo"] and events[6].data["text"] == "hello"
    assert events[8].data["item"]["content"][0]["text"] == "hello"
    assert events[-1].data["response"]["usage"]["output_tokens"] == 3
    assert all(e.data.get("item_id", "msg_ab") == "msg_ab" for e in events)


def test_a_cut_stream_ends_incomplete_and_a_failed_one_says_so():
    render = responses(input="x", stream=True).renderer
    assert render.done(CUT)[-1].data["type"] == "response.incomplete"
    error, failed = responses(input="x", stream=True).renderer.failed(ApiError(503, "lost", code="worker_lost"))
    assert error.data["type"] == "error" and error.data["code"] == "worker_lost"
    assert failed.data["response"]["status"] == "failed" and failed.data["response"]["error"]["code"] == "worker_lost"
    assert "error" not in failed.data  # the client reads a top-level `error` as its own failure


def test_the_frames_cross_the_wire_schema():
    """The frames built here hold the wire's ranges: the worker decodes what the edge seals."""
    for frame in (completions(prompt=[1, 2]).frame, completions(prompt="x").frame, responses(input="x").frame):
        messages = [wire.Message(m.role, m.content) for m in frame.messages]
        request = wire.ChatRequest("r", "e", "c", "t", messages, frame.max_tokens, prompt=frame.prompt)
        assert wire.decode(wire.encode(request), wire.ChatRequest) == request
