"""The client chat protocol v1: parse client frames and build edge frames, with no I/O.

Client -> edge: `chat`, `cancel` and `resume` JSON text frames. Edge -> client:
`accepted` (with a resume token), `resumed`, `token`, `done`, `error`. Parsing returns a typed frame or raises `ProtocolError`
carrying the code and the chat id (when one could be read) for the error frame.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from shared import wire

Role = Literal["system", "user", "assistant"]


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Role
    content: str


ChatId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class ChatFrame(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["chat"]
    id: ChatId
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 256
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 0.7
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    seed: int | None = None
    conversation: str | None = None


class CancelFrame(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["cancel"]
    id: ChatId


class ResumeFrame(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Continue a stream whose socket dropped, on any edge, within the grace period."""

    type: Literal["resume"]
    id: ChatId
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    resume_token: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    last_seq: Annotated[int, msgspec.Meta(ge=-1)] = -1  # -1: nothing received yet


ClientFrame = ChatFrame | CancelFrame | ResumeFrame
FRAME_TYPES: dict[str, type] = {"chat": ChatFrame, "cancel": CancelFrame, "resume": ResumeFrame}


class ProtocolError(Exception):
    """A frame we refuse; the socket stays open and the client gets an error frame."""

    def __init__(self, code: str, message: str, chat_id: str | None = None, retryable: bool = False):
        super().__init__(message)
        self.code = code
        self.message = message
        self.chat_id = chat_id
        self.retryable = retryable


def parse_client_frame(text: str | bytes) -> ClientFrame:
    try:
        raw = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ProtocolError("invalid_json", f"frame is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ProtocolError("invalid_message", "frame must be a JSON object")
    chat_id = raw.get("id") if isinstance(raw.get("id"), str) else None
    kind = raw.get("type")
    if kind not in FRAME_TYPES:
        known = ", ".join(FRAME_TYPES)
        raise ProtocolError("unknown_type", f"unknown frame type {kind!r}; expected one of: {known}", chat_id)
    try:
        return msgspec.convert(raw, FRAME_TYPES[kind])
    except msgspec.ValidationError as exc:
        raise ProtocolError("invalid_message", str(exc), chat_id) from exc


def accepted_frame(chat_id: str, request_id: str, resume_token: str) -> dict[str, Any]:
    return {"type": "accepted", "id": chat_id, "request_id": request_id, "resume_token": resume_token}


def resumed_frame(chat_id: str, request_id: str, next_seq: int) -> dict[str, Any]:
    return {"type": "resumed", "id": chat_id, "request_id": request_id, "next_seq": next_seq}


def error_frame(chat_id: str | None, code: str, message: str, retryable: bool = False) -> dict[str, Any]:
    return {"type": "error", "id": chat_id, "code": code, "message": message, "retryable": retryable}


def event_frame(chat_id: str, event: wire.Event) -> dict[str, Any]:
    """The client frame for one token-path event."""
    if isinstance(event, wire.Token):
        return {"type": "token", "id": chat_id, "seq": event.seq, "text": event.text}
    if isinstance(event, wire.Done):
        usage = event.usage
        return {
            "type": "done",
            "id": chat_id,
            "finish_reason": event.finish_reason,
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.cached_tokens,
                "completion_tokens": usage.completion_tokens,
            },
        }
    return error_frame(chat_id, event.code, event.message, event.retryable)


def encode_frame(frame: dict[str, Any]) -> str:
    return msgspec.json.encode(frame).decode()
