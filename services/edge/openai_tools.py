"""A reply's tool calls in OpenAI's shapes: the message of a whole completion, and the deltas of a stream."""

from __future__ import annotations

from typing import Any

from shared.models.tool_call_parser import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    Delta,
    ParsedReply,
    parse_reply,
)


def reply_message(text: str, tool_calls: bool) -> tuple[dict[str, Any], bool]:
    """The assistant message of a whole reply, and whether it called tools."""
    reply = parse_reply(text) if tool_calls else ParsedReply(text)
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    if reply.calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.calls
        ]
    return message, bool(reply.calls)


def delta_body(delta: Delta) -> dict[str, Any]:
    """One parsed piece of a stream as a chunk's `delta`."""
    if isinstance(delta, ContentDelta):
        return {"content": delta.text}
    if isinstance(delta, CallStart):
        call = {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name, "arguments": ""}}  # fmt: skip
        return {"tool_calls": [call]}
    assert isinstance(delta, ArgumentsDelta)
    return {"tool_calls": [{"index": delta.index, "function": {"arguments": delta.text}}]}
