"""The client chat protocol v1: client frames parsed, edge frames built, all typed, with no I/O.

Client -> edge: `chat`, `cancel` and `resume` JSON text frames. Edge -> client: `accepted` (with
a resume token), `resumed`, `token`, `done`, `error`. Parsing returns a typed frame or raises
`ProtocolError` carrying the code and the chat id (when one could be read) for the error frame.
"""

from __future__ import annotations

import reprlib
from typing import Annotated, Literal

import msgspec

from services.edge.structured_request import (
    ResponseFormat,
    StructuredOutputs,
    ToolCallFrame,
    ToolChoice,
    ToolSpec,
    wire_messages,
)
from shared import wire
from shared.codes import ErrorCode, FinishReason, clipped
from shared.models.raw_prompt import PromptInput, RawPrompt

MAX_CHAT_ID = 128
ChatId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CHAT_ID)]


# Client -> edge ---------------------------------------------------------------------------------
class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: wire.Role
    content: str
    tool_calls: list[ToolCallFrame] = []  # an assistant turn's calls, as OpenAI returned them
    tool_call_id: str = ""  # a `tool` turn: the call whose result it is


class ChatFrame(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["chat"]
    id: ChatId
    messages: list[ChatMessage] = []  # the conversation; exactly one of it and `prompt` is given
    max_tokens: wire.MaxTokens = wire.DEFAULT_MAX_TOKENS
    temperature: wire.Temperature = wire.DEFAULT_TEMPERATURE
    top_p: wire.TopP = wire.DEFAULT_TOP_P
    seed: wire.Seed | None = None
    priority: wire.Priority = 0  # among this tenant's own waiting chats: lower is served first
    # Sampling controls (wire.Controls), each off by default.
    top_k: wire.TopK = 0
    stop: wire.StopStrings = []  # the text ends before the first of these (not included)
    stop_token_ids: wire.StopTokenIds = []
    ignore_eos: bool = False
    min_tokens: wire.MaxTokens | Literal[0] = 0
    frequency_penalty: wire.Penalty = 0.0
    presence_penalty: wire.Penalty = 0.0
    repetition_penalty: wire.RepetitionPenalty = 1.0
    logit_bias: wire.LogitBias = {}  # token id -> bias added to its logit
    logprobs: wire.TopLogprobs | None = None  # k: each token's log-probability and its k likeliest alternatives'
    # A conversation id: its turns stay on one worker while the load bound allows (placement.py).
    conversation: str | None = None
    # Structured output and tools (structured_request.py), in OpenAI's shapes; vLLM's regex/choice extension.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    tools: list[ToolSpec] = []
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    prompt: wire.PromptText | wire.PromptTokenIds | None = None  # raw text or token ids, without the chat template

    def __post_init__(self) -> None:
        if bool(self.messages) == (self.prompt is not None):
            raise ValueError("a chat has either `messages` (at least one) or `prompt`")

    def controls(self) -> wire.Controls:
        return wire.Controls(**{name: getattr(self, name) for name in wire.Controls.__struct_fields__})

    def prompt_input(self) -> PromptInput:
        """What the model computes from: the messages (as the wire carries them, calls and all), or the raw prompt."""
        return RawPrompt.of(self.prompt) if self.prompt is not None else wire_messages(self.messages)


class CancelFrame(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["cancel"]
    id: ChatId


class ResumeFrame(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Continue a stream whose socket dropped, on any edge, within the grace period."""

    type: Literal["resume"]
    id: ChatId
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    resume_token: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    last_seq: wire.LastSeq = -1  # -1: nothing received yet


ClientFrame = ChatFrame | CancelFrame | ResumeFrame
FRAME_TYPES: dict[str, type] = {"chat": ChatFrame, "cancel": CancelFrame, "resume": ResumeFrame}


class ProtocolError(Exception):
    """A frame we refuse; the socket stays open and the client gets an error frame."""

    def __init__(self, code: ErrorCode, message: str, chat_id: str | None = None, retry_after_ms: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = clipped(message)
        self.chat_id = chat_id
        self.retry_after_ms = retry_after_ms

    def frame(self) -> ErrorFrame:
        return ErrorFrame(self.chat_id, self.code, self.message, self.code.retryable, self.retry_after_ms)


NESTED_TOO_DEEPLY = "JSON nested too deeply"


def _echoed_id(value: object) -> str | None:
    """The frame's id as its error frame carries it: only one a chat could have. An id the client
    may not use correlates nothing, and echoing whatever was sent would mirror a frame's worth of
    bytes back per frame."""
    return value if isinstance(value, str) and 0 < len(value) <= MAX_CHAT_ID else None


def parse_client_frame(text: str | bytes) -> ClientFrame:
    try:
        raw = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ProtocolError(ErrorCode.INVALID_JSON, f"frame is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        # msgspec stops at the interpreter's recursion limit; no frame of ours nests a tenth as deep.
        raise ProtocolError(ErrorCode.INVALID_JSON, f"frame is not valid JSON: {NESTED_TOO_DEEPLY}") from exc
    if not isinstance(raw, dict):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "frame must be a JSON object")
    chat_id = _echoed_id(raw.get("id"))
    kind = raw.get("type")
    if kind not in FRAME_TYPES:
        known = ", ".join(FRAME_TYPES)
        # reprlib: the type sent, cut short, before the types to send (the message's point).
        message = f"unknown frame type {reprlib.repr(kind)}; expected one of: {known}"
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, message, chat_id)
    try:
        return msgspec.convert(raw, FRAME_TYPES[kind], str_keys=True)  # JSON keys of logit_bias are token ids
    except msgspec.ValidationError as exc:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, str(exc), chat_id) from exc


# Edge -> client ---------------------------------------------------------------------------------
class AcceptedFrame(msgspec.Struct, frozen=True, tag_field="type", tag="accepted"):
    id: str
    request_id: str
    resume_token: str


class ResumedFrame(msgspec.Struct, frozen=True, tag_field="type", tag="resumed"):
    id: str
    request_id: str
    next_seq: int


class LogprobBody(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    top_logprobs: list[tuple[str, float]] = []


class TokenFrame(msgspec.Struct, frozen=True, tag_field="type", tag="token", omit_defaults=True):
    id: str
    seq: int
    text: str
    logprobs: list[LogprobBody] = []  # only when the chat asked for logprobs


class UsageBody(msgspec.Struct, frozen=True):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class DoneFrame(msgspec.Struct, frozen=True, tag_field="type", tag="done", omit_defaults=True):
    id: str
    finish_reason: FinishReason
    usage: UsageBody
    # Only for a chat whose reply is read for tool calls (tools given, tool_choice not "none"; see
    # tool_replies.py): its calls, as an assistant message takes them back, and its text around them.
    tool_calls: list[ToolCallFrame] | None = None
    content: str | None = None


class ErrorFrame(msgspec.Struct, frozen=True, tag_field="type", tag="error", omit_defaults=True):
    id: str | None
    code: ErrorCode
    message: str
    retryable: bool
    retry_after_ms: int | None = None  # overloaded, rate_limited: when a retry may succeed


EdgeFrame = AcceptedFrame | ResumedFrame | TokenFrame | DoneFrame | ErrorFrame


def event_frame(chat_id: str, event: wire.Token | wire.Done | wire.Error) -> TokenFrame | DoneFrame | ErrorFrame:
    """The client frame for one token-path event."""
    if isinstance(event, wire.LoggedToken):
        logprobs = [LogprobBody(lp.token, lp.logprob, lp.top) for lp in event.logprobs]
        return TokenFrame(chat_id, event.seq, event.text, logprobs)
    if isinstance(event, wire.Token):
        return TokenFrame(chat_id, event.seq, event.text)
    if isinstance(event, wire.Done):
        usage = event.usage
        return DoneFrame(chat_id, event.finish_reason, UsageBody(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens))
    return ErrorFrame(chat_id, event.code, event.message, event.retryable)


_encoder = msgspec.json.Encoder()


def encode_frame(frame: EdgeFrame) -> str:
    return _encoder.encode(frame).decode()
