"""Tool calls for chat-protocol clients: a chat whose reply is read for calls (its tools given, and
`tool_choice` not "none") streams its text as ever, and its `done` frame carries the calls parsed from it.

The tokens stay the model's text exactly as produced, so seq numbers, resumes and replays mean what
they always did; the calls are read from the whole text once it is complete. Pure, no I/O.
"""

from __future__ import annotations

import msgspec

from services.edge.protocol import DoneFrame, ErrorFrame, TokenFrame
from services.edge.structured_request import FunctionCall, ToolCallFrame
from shared.models.tool_call_parser import parse_reply


class ToolReply:
    """The text of one reply, kept until its `done`; then `done.tool_calls` (a list, empty when the reply
    called nothing) and, when it did call, `done.content`: the text outside the calls (omitted when none)."""

    def __init__(self) -> None:
        self._pieces: list[str] = []

    def read(self, frame: TokenFrame | DoneFrame | ErrorFrame) -> TokenFrame | DoneFrame | ErrorFrame:
        """The frame as the client gets it: a token is kept, a done gets the calls."""
        if isinstance(frame, TokenFrame):
            self._pieces.append(frame.text)
            return frame
        if not isinstance(frame, DoneFrame):
            return frame
        reply = parse_reply("".join(self._pieces))
        self._pieces = []
        calls = [ToolCallFrame(c.id, "function", FunctionCall(c.name, c.arguments)) for c in reply.calls]
        return msgspec.structs.replace(frame, tool_calls=calls, content=reply.content if calls else None)
