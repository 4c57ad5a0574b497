"""Tool calls for chat-protocol clients, pure: a chat read for calls streams its text unchanged and its
`done` frame carries the calls; a chat without tools, or resumed elsewhere, keeps the done it always had."""

from __future__ import annotations

import json

from services.edge.connection import Connection
from services.edge.protocol import DoneFrame, TokenFrame, UsageBody, encode_frame
from services.edge.tool_replies import ToolReply
from shared import wire
from shared.codes import FinishReason

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
USAGE = UsageBody(prompt_tokens=3, cached_tokens=0, completion_tokens=5)


def done() -> DoneFrame:
    return DoneFrame("c1", FinishReason.STOP, USAGE)


def test_the_done_frame_carries_the_calls_and_the_text_around_them():
    reply = ToolReply()
    for i, piece in enumerate(["Checking. ", CALL[:20], CALL[20:]]):
        token = TokenFrame("c1", i, piece)
        assert reply.read(token) is token  # the text goes out exactly as produced
    body = json.loads(encode_frame(reply.read(done())))
    (call,) = body["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert body["content"] == "Checking." and body["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 5


def test_a_reply_that_calls_nothing_says_so_with_an_empty_list():
    reply = ToolReply()
    reply.read(TokenFrame("c1", 0, "Sunny, I think."))
    body = json.loads(encode_frame(reply.read(done())))
    assert body["tool_calls"] == [] and "content" not in body  # its text is the tokens already sent


def test_a_call_whose_arguments_do_not_parse_is_text():
    reply = ToolReply()
    reply.read(TokenFrame("c1", 0, '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'))
    assert reply.read(done()).tool_calls == []


def test_a_done_without_tools_encodes_as_it_always_did():
    assert json.loads(encode_frame(done())) == {
        "type": "done", "id": "c1", "finish_reason": "stop",
        "usage": {"prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": 5},
    }  # fmt: skip


async def delivered(reads_tools: bool) -> list:
    """The frames a connection writes for one chat's token and done."""
    sent: list = []

    async def sink(frame) -> None:
        sent.append(frame)

    conn = Connection("k", "t", sink)
    conn.open_chat("c1", "r1", reads_tools=reads_tools)
    conn.deliver(wire.Token("r1", 0, CALL))
    conn.deliver(wire.Done("r1", 1, FinishReason.STOP, wire.Usage(3, 0, 1)))
    conn.close_writer()
    await conn.run_writer()
    return sent


async def test_a_connection_reads_the_calls_of_the_chats_that_asked():
    token, end = await delivered(reads_tools=True)
    assert token.text == CALL and end.tool_calls[0].function.name == "get_weather"
    assert (await delivered(reads_tools=False))[1].tool_calls is None
