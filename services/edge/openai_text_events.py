"""What the text endpoints (/v1/completions, /v1/responses) share: how a request body is decoded into
OpenAI's errors, server-sent events, and the renderer each endpoint gives the HTTP shell.

Pure, no I/O; `openai_text_api` wires renderers to HTTP.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from services.edge.openai_schema import ApiError, decode_body
from services.edge.protocol import ChatFrame, DoneFrame, LogprobBody


def unsupported(param: str, why: str = "is not supported by this server") -> ApiError:
    return ApiError(400, f"`{param}` {why}", code="unsupported_parameter", param=param)


def check_model(model: str, served_model: str) -> None:
    if model != served_model:
        raise ApiError(
            400, f"The model `{model}` does not exist; this server serves `{served_model}`",
            code="model_not_found", param="model",
        )  # fmt: skip


def decode_checked(decoder: msgspec.json.Decoder[Any], body: bytes, neutral: dict[str, Callable[[Any], bool]],
                   served_model: str) -> Any:
    """A text endpoint's body decoded, with what every such endpoint refuses refused: a field we do
    not honour set to anything but its neutral value, another model, stream_options without stream."""
    request = decode_body(decoder, body)
    for name, is_neutral in neutral.items():
        if not is_neutral(getattr(request, name)):
            raise unsupported(name)
    check_model(request.model, served_model)
    if request.stream_options is not None and not request.stream:
        raise ApiError(
            400, "`stream_options` is only allowed when `stream` is true", code="invalid_value", param="stream_options"
        )
    return request


@dataclass(frozen=True)
class SseEvent:
    """One server-sent event: `data` as JSON (or a bare sentinel such as `[DONE]`), under an `event:` name if set."""

    data: dict[str, Any] | str
    event: str | None = None


_encoder = msgspec.json.Encoder()


def encode_events(events: list[SseEvent]) -> bytes:
    out = bytearray()
    for e in events:
        if e.event is not None:
            out += b"event: " + e.event.encode() + b"\n"
        out += b"data: " + (e.data.encode() if isinstance(e.data, str) else _encoder.encode(e.data)) + b"\n\n"
    return bytes(out)


class Renderer(Protocol):
    """One response's bodies and events, in the endpoint's shape; may keep state (a sequence number)."""

    prompt_param: str  # what a too-long prompt's error names: the endpoint's prompt field

    def body(self, text: str, done: DoneFrame, logprobs: Sequence[LogprobBody] = ()) -> dict[str, Any]:
        """The whole response, not streamed; `logprobs` those of its tokens, when the request asked."""

    def opening(self) -> list[SseEvent]:
        """The events before the first token."""

    def token(self, text: str, logprobs: Sequence[LogprobBody] = ()) -> list[SseEvent]: ...

    def done(self, done: DoneFrame) -> list[SseEvent]:
        """The events that end a stream, its sentinel included."""

    def failed(self, error: ApiError) -> list[SseEvent]:
        """The events of a stream that fails after its status (200) went out."""


@dataclass(frozen=True)
class ParsedText:
    """A request as `EdgeService.start_chat` admits it, and how its answer is written; `finished`, when set,
    is awaited with the whole answer's text before its last body or event goes out (a stored response is
    then already readable when the client sees it end)."""

    frame: ChatFrame
    stream: bool
    renderer: Renderer
    finished: Callable[[str, DoneFrame], Awaitable[None]] | None = None
