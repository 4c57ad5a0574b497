"""OpenAI's legacy text completions (/v1/completions): the request we accept (a ChatFrame with a raw
prompt), and the bodies and chunks we send. Pure functions, no I/O."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from services.edge.completion_logprobs import (
    MAX_COMPLETION_LOGPROBS,
    CompletionLogprobs,
)
from services.edge.openai_schema import (
    ApiError,
    CompletionHeader,
    SamplingFields,
    StreamOptions,
    finish_reason_of,
    sampling_controls,
    usage_body,
)
from services.edge.openai_text_events import (
    ParsedText,
    SseEvent,
    decode_checked,
    unsupported,
)
from services.edge.protocol import ChatFrame, DoneFrame, LogprobBody
from shared import wire

DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for this endpoint (chat's is the protocol's, 256)
Prompt = wire.PromptText | wire.PromptTokenIds


class CompletionsRequest(SamplingFields, frozen=True, forbid_unknown_fields=True, kw_only=True):
    model: str
    # A string, token ids, or a list of one of either; checked by `prompt_of` (a msgspec union holds one array type).
    prompt: str | list[Any]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: wire.MaxTokens | None = None
    echo: bool | None = None
    # The likeliest alternatives of each token to return with it (0: the token's own logprob only).
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    # Accepted only at their neutral value (see NEUTRAL).
    n: int | None = None
    best_of: int | None = None
    suffix: str | None = None


NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v in (None, 1),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: not v,
}


def prompt_of(value: str | list[Any]) -> Prompt:
    """The prompt as the wire carries it: one non-empty text, or one non-empty list of token ids
    (a list holding exactly one of either is that one; more are `n` > 1 prompts, which we lack)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    elif isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        raise unsupported("prompt", "with more than one prompt is not supported by this server; send one per request")
    try:
        return msgspec.convert(value, Prompt)
    except msgspec.ValidationError as exc:
        message = f"Invalid prompt: expected a non-empty string or a non-empty list of token ids ({exc})"
        raise ApiError(400, message, code="invalid_value", param="prompt") from exc


def parse_completions_request(body: bytes, served_model: str, chat_id: str, head: CompletionHeader) -> ParsedText:
    """The body as a chat frame with a raw prompt; ApiError (400) when we cannot honour it."""
    request: CompletionsRequest = decode_checked(_decoder, body, NEUTRAL, served_model)
    prompt = prompt_of(request.prompt)
    if request.echo and not isinstance(prompt, str):
        raise unsupported("echo", "of a token-id prompt is not supported by this server; send the prompt as text")
    if request.echo and request.logprobs is not None:  # they would cover the prompt's tokens too, which we lack
        raise unsupported("logprobs", "with `echo` (the prompt's logprobs) is not supported by this server")
    frame = ChatFrame(
        type="chat",
        id=chat_id,
        prompt=prompt,
        max_tokens=request.max_tokens or DEFAULT_MAX_TOKENS,
        conversation=request.user,
        logprobs=request.logprobs,
        **sampling_controls(request),
    )
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    echoed = prompt if request.echo and isinstance(prompt, str) else ""
    logprobs = CompletionLogprobs() if request.logprobs is not None else None
    return ParsedText(frame, bool(request.stream), CompletionsRenderer(head, echoed, include_usage, logprobs))


_decoder = msgspec.json.Decoder(CompletionsRequest)


@dataclass
class CompletionsRenderer:
    """`text_completion` bodies and chunks; `echoed` (the prompt, with `echo`) comes before the completion;
    `logprobs` set: the request asked for them, and each choice or chunk carries its tokens'."""

    head: CompletionHeader
    echoed: str = ""
    include_usage: bool = False
    logprobs: CompletionLogprobs | None = None
    prompt_param: str = "prompt"

    def body(self, text: str, done: DoneFrame, logprobs: Sequence[LogprobBody] = ()) -> dict[str, Any]:
        choice = self._choice(self.echoed + text, finish_reason_of(done.finish_reason), self._logprobs(logprobs))
        return {**self._top(), "choices": [choice], "usage": usage_body(done.usage)}

    def opening(self) -> list[SseEvent]:
        return [self._chunk(self.echoed, None)] if self.echoed else []

    def token(self, text: str, logprobs: Sequence[LogprobBody] = ()) -> list[SseEvent]:
        return [self._chunk(text, None, self._logprobs(logprobs))]

    def _logprobs(self, logprobs: Sequence[LogprobBody]) -> dict[str, Any] | None:
        return self.logprobs.take(logprobs) if self.logprobs is not None else None

    def done(self, done: DoneFrame) -> list[SseEvent]:
        events = [self._chunk("", finish_reason_of(done.finish_reason))]
        if self.include_usage:  # as OpenAI: a last chunk with no choices carries the usage
            events.append(SseEvent({**self._top(), "choices": [], "usage": usage_body(done.usage)}))
        return [*events, SseEvent("[DONE]")]

    def failed(self, error: ApiError) -> list[SseEvent]:
        return [SseEvent(error.body())]  # and no `[DONE]`: the stream did not finish

    def _top(self) -> dict[str, Any]:
        head = self.head
        return {"id": head.id, "object": "text_completion", "created": head.created, "model": head.model,
                "system_fingerprint": None}  # fmt: skip

    @staticmethod
    def _choice(text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}

    def _chunk(self, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> SseEvent:
        chunk = {**self._top(), "choices": [self._choice(text, finish_reason, logprobs)]}
        if self.include_usage:
            chunk["usage"] = None  # only the last chunk carries usage
        return SseEvent(chunk)
