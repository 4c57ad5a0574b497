"""Reads tool calls out of a model's text as it streams: plain text passes through as content,
each <tool_call>...</tool_call> becomes a call whose arguments arrive as deltas (OpenAI's way of
streaming them). A whole reply is parsed by feeding it at once (`parse_reply`). Pure, no I/O.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from shared.models.tool_calls import CALL_CLOSE, CALL_OPEN

# The start of a call as models write it: the name first, then the arguments.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


Delta = ContentDelta | CallStart | ArgumentsDelta


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of text could begin `tag`: held back until the next piece."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


@dataclass
class ToolCallStream:
    """Feed text pieces in order, then `finish`; each call returns the deltas the text so far allows."""

    _buffer: str = ""
    _in_call: bool = False
    _num_calls: int = 0
    _args_start: int = -1  # where the open call's arguments begin in the buffer; -1: header not read yet
    _args_sent: int = 0  # characters of them already sent

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        deltas: list[Delta] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(CALL_OPEN)
                if start < 0:
                    keep = _held_prefix(self._buffer, CALL_OPEN)
                    self._content(deltas, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return deltas
                self._content(deltas, self._buffer[:start])
                self._buffer = self._buffer[start + len(CALL_OPEN) :]
                self._in_call, self._args_start, self._args_sent = True, -1, 0
            end = self._buffer.find(CALL_CLOSE)
            if end < 0:
                self._stream_arguments(deltas)
                return deltas
            body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_CLOSE) :]
            self._end_call(deltas, body, closed=True)

    def finish(self) -> list[Delta]:
        """The rest: an unclosed call (the model stopped inside it) ends as it stands."""
        deltas: list[Delta] = []
        if self._in_call:
            body, self._buffer = self._buffer, ""
            self._end_call(deltas, body, closed=False)
        else:
            self._content(deltas, self._buffer)
            self._buffer = ""
        return deltas

    def _content(self, deltas: list[Delta], text: str) -> None:
        # Between and after calls, the model's line breaks are layout, not content.
        if text and not (self._num_calls and not text.strip()):
            deltas.append(ContentDelta(text))

    def _stream_arguments(self, deltas: list[Delta]) -> None:
        if self._args_start < 0:
            header = _HEADER.match(self._buffer)
            if header is None:
                return
            name = json.loads(f'"{header.group("name")}"')
            deltas.append(CallStart(self._num_calls, new_call_id(), name))
            self._args_start = header.end()
        # Held back: a trailing run of braces and space (the last brace closes the call, not the
        # arguments) and what may begin the closing tag.
        arguments = self._buffer[self._args_start :]
        arguments = arguments[: len(arguments) - _held_prefix(arguments, CALL_CLOSE)]
        safe = len(arguments.rstrip("} \n\t\r"))
        if safe > self._args_sent:
            deltas.append(ArgumentsDelta(self._num_calls, arguments[self._args_sent : safe]))
            self._args_sent = safe

    def _end_call(self, deltas: list[Delta], body: str, closed: bool) -> None:
        if not closed:  # the model stopped inside the closing tag
            body = body[: len(body) - _held_prefix(body, CALL_CLOSE)]
        self._stream_arguments(deltas)
        index = self._num_calls
        if self._args_start >= 0:
            arguments = body[self._args_start :].rstrip()
            arguments = arguments[:-1].rstrip() if arguments.endswith("}") else arguments
            if len(arguments) > self._args_sent:
                deltas.append(ArgumentsDelta(index, arguments[self._args_sent :]))
        else:
            call = _loads_call(body)
            if call is None:  # not a call after all: the text goes out as it came
                self._content(deltas, CALL_OPEN + body + (CALL_CLOSE if closed else ""))
                self._in_call = False
                return
            deltas.append(CallStart(index, new_call_id(), call[0]))
            deltas.append(ArgumentsDelta(index, call[1]))
        self._num_calls += 1
        self._in_call = False


def _loads_call(body: str) -> tuple[str, str] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ParsedReply:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def collect(deltas: list[Delta]) -> ParsedReply:
    """Deltas put back together: the content, and each call with its whole arguments."""
    content: list[str] = []
    calls: list[ParsedCall] = []
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content.append(delta.text)
        elif isinstance(delta, CallStart):
            calls.append(ParsedCall(delta.id, delta.name))
        else:
            calls[delta.index].arguments += delta.text
    text = "".join(content)
    return ParsedReply(text.strip() or None if calls else text, calls)


def parse_reply(text: str) -> ParsedReply:
    """A whole reply's content and calls; a reply whose calls' arguments do not parse is all content."""
    stream = ToolCallStream()
    reply = collect(stream.feed(text) + stream.finish())
    for call in reply.calls:
        try:
            json.loads(call.arguments)
        except ValueError:
            return ParsedReply(text)
    return reply
