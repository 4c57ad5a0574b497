"""OpenAI chat-completion shapes on the edge: the request we accept (as a ChatFrame), the bodies and errors we send.

Pure functions, no I/O; `openai_api` wires them to HTTP.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from services.edge.protocol import (
    NESTED_TOO_DEEPLY,
    ChatFrame,
    ChatMessage,
    DoneFrame,
    UsageBody,
)
from shared import wire
from shared.codes import ErrorCode, FinishReason

# Absent sampling fields take OpenAI's documented defaults, which clients of this API
# expect; absent max tokens take the chat protocol's default, so both paths cap alike.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
RETRY_AFTER_S = 1


class ApiError(Exception):
    """A refusal in OpenAI's error shape, with its HTTP status (and Retry-After when the client should wait)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Request -------------------------------------------------------------------------------
class TextPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class InputMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # "developer" is OpenAI's newer name for "system"; tool turns need tool calling, which we lack.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # accepted and ignored: the chat template has no place for it

    def as_chat_message(self) -> ChatMessage:
        role = "system" if self.role == "developer" else self.role
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return ChatMessage(role=role, content=text)


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # we never pad chunks, so either value is honoured


PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class CompletionRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str
    messages: Annotated[list[InputMessage], msgspec.Meta(min_length=1)]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: wire.MaxTokens | None = None
    max_completion_tokens: wire.MaxTokens | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    seed: wire.Seed | None = None
    priority: wire.Priority | None = None  # as vLLM's: among the tenant's own waiting requests, lower first
    n: PositiveInt | None = None
    # Harmless: bookkeeping that does not change what is generated (prompt_cache_key, else user,
    # keeps a conversation on one worker, as the chat frame's `conversation` does).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # Sampling controls: OpenAI's, then vLLM's extras.
    presence_penalty: wire.Penalty | None = None
    frequency_penalty: wire.Penalty | None = None
    logit_bias: wire.LogitBias | None = None
    stop: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | wire.StopStrings | None = None
    top_k: wire.TopK | None = None
    min_tokens: wire.MaxTokens | Literal[0] | None = None
    repetition_penalty: wire.RepetitionPenalty | None = None
    ignore_eos: bool | None = None
    stop_token_ids: wire.StopTokenIds | None = None
    # Accepted only at their neutral value (see NEUTRAL); anything else we cannot honour.
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: Any = None
    modalities: list[str] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None


NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v in (None, 1),
    "logprobs": lambda v: not v,
    "top_logprobs": lambda v: not v,
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none", "auto"),  # with no tools, "auto" calls none
    "response_format": lambda v: v is None or v == {"type": "text"},
    "modalities": lambda v: v is None or v == ["text"],
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "verbosity": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}


@dataclass(frozen=True)
class ParsedCompletion:
    frame: ChatFrame
    stream: bool
    include_usage: bool


_decoder = msgspec.json.Decoder(CompletionRequest)
_AT_PATH = re.compile(r" - at `(?:key` in `)?\$\.?(?P<path>[^`]*)`$")  # a dict key's reason names its dict
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`")
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<field>[^`]*)`")


def parse_completion_request(body: bytes, served_model: str, chat_id: str) -> ParsedCompletion:
    """The request body as a chat frame for `EdgeService.start_chat`; ApiError (400) when we cannot honour it."""
    try:
        request = _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from exc
    except RecursionError as exc:  # msgspec stops at the interpreter's recursion limit
        message = f"We could not parse the JSON body of your request: {NESTED_TOO_DEEPLY}"
        raise ApiError(400, message, code="invalid_json") from exc
    for field, is_neutral in NEUTRAL.items():
        if not is_neutral(getattr(request, field)):
            raise ApiError(400, f"`{field}` is not supported by this server", code="unsupported_parameter", param=field)
    if request.model != served_model:
        raise ApiError(
            400, f"The model `{request.model}` does not exist; this server serves `{served_model}`",
            code="model_not_found", param="model",
        )
    if request.stream_options is not None and not request.stream:
        raise ApiError(
            400, "`stream_options` is only allowed when `stream` is true", code="invalid_value", param="stream_options"
        )
    cap = request.max_completion_tokens or request.max_tokens
    limit = {"max_tokens": cap} if cap else {}
    frame = ChatFrame(
        type="chat",
        id=chat_id,
        messages=[m.as_chat_message() for m in request.messages],
        temperature=DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        top_p=DEFAULT_TOP_P if request.top_p is None else request.top_p,
        seed=request.seed,
        priority=request.priority or 0,
        conversation=request.prompt_cache_key or request.user,  # what OpenAI routes its cache by
        **limit,
        **_controls(request),
    )
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return ParsedCompletion(frame, bool(request.stream), include_usage)


def _controls(request: CompletionRequest) -> dict[str, Any]:
    """The sampling controls the request set, by their chat frame names."""
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    given = {
        "stop": stop, "frequency_penalty": request.frequency_penalty, "presence_penalty": request.presence_penalty,
        "logit_bias": request.logit_bias, "top_k": request.top_k, "min_tokens": request.min_tokens,
        "repetition_penalty": request.repetition_penalty, "ignore_eos": request.ignore_eos,
        "stop_token_ids": request.stop_token_ids,
    }  # fmt: skip
    return {name: value for name, value in given.items() if value is not None}


def _validation_error(reason: str) -> ApiError:
    """msgspec's reason with the offending field named as OpenAI's `param`."""
    at = _AT_PATH.search(reason)
    path = at.group("path").replace("[...]", "") if at else ""  # a dict value: name the dict
    if unknown := _UNKNOWN_FIELD.match(reason):
        param = f"{path}.{unknown.group('field')}" if path else unknown.group("field")
        return ApiError(400, f"Unrecognized request argument supplied: {param}", code="unknown_parameter", param=param)
    if missing := _MISSING_FIELD.match(reason):
        path = f"{path}.{missing.group('field')}" if path else missing.group("field")
    return ApiError(400, f"Invalid request: {reason}", code="invalid_value", param=path or None)


# Refusals and failures ---------------------------------------------------------------------
# Edge refusal and worker error codes -> (HTTP status, OpenAI error type, OpenAI error code).
_STATUS_OF: dict[ErrorCode, tuple[int, str, str]] = {
    ErrorCode.INVALID_MESSAGE: (400, "invalid_request_error", "invalid_value"),
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error", "invalid_value"),
    ErrorCode.PROMPT_TOO_LONG: (400, "invalid_request_error", "context_length_exceeded"),
    ErrorCode.TOO_MANY_CHATS: (429, "rate_limit_error", "too_many_chats"),
    ErrorCode.UNAVAILABLE: (503, "server_error", "unavailable"),
    ErrorCode.WORKER_LOST: (503, "server_error", "worker_lost"),
    ErrorCode.WORKER_DRAINING: (503, "server_error", "worker_draining"),
    ErrorCode.EDGE_DRAINING: (503, "server_error", "edge_draining"),
    ErrorCode.NO_WORKER: (503, "server_error", "no_worker"),
    ErrorCode.REQUEST_QUARANTINED: (500, "server_error", "request_quarantined"),
}


def refusal_error(code: ErrorCode, message: str, retry_after_ms: int | None = None) -> ApiError:
    """The HTTP error for a ProtocolError or an error frame; other retryable codes ask the client to back off
    (for `retry_after_ms` when the refusal says how long, rounded up to whole seconds)."""
    status, type_, api_code = _STATUS_OF.get(code) or (
        (429, "rate_limit_error", code.value) if code.retryable else (500, "server_error", code.value)
    )
    param = "messages" if code is ErrorCode.PROMPT_TOO_LONG else None
    retry_after = None
    if status in (429, 503):
        retry_after = -(-retry_after_ms // 1000) if retry_after_ms else RETRY_AFTER_S
    return ApiError(status, message, type_, api_code, param, retry_after)


# Responses ---------------------------------------------------------------------------------
# OpenAI has no "cancelled": a client only cancels by going away, and then reads nothing;
# a cancel it did not cause (say, an operator's) ended the answer early, which "stop" tells
# every client that knows the documented values. Unknown reasons fall back to "stop" too.
_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "stop"}


def finish_reason_of(reason: FinishReason) -> str:
    return _FINISH_REASONS.get(reason, "stop")


def usage_body(usage: UsageBody) -> dict[str, Any]:
    """OpenAI usage from a `done` frame's usage."""
    prompt, completion = usage.prompt_tokens, usage.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass(frozen=True)
class CompletionHeader:
    """What every body of one completion repeats."""

    id: str
    created: int
    model: str


def completion_body(head: CompletionHeader, text: str, done: DoneFrame) -> dict[str, Any]:
    return {
        "id": head.id,
        "object": "chat.completion",
        "created": head.created,
        "model": head.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason_of(done.finish_reason),
            }
        ],
        "usage": usage_body(done.usage),
        "system_fingerprint": None,
    }


def chunk_body(
    head: CompletionHeader, delta: dict[str, str], finish_reason: str | None, include_usage: bool
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": head.id,
        "object": "chat.completion.chunk",
        "created": head.created,
        "model": head.model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        "system_fingerprint": None,
    }
    if include_usage:
        chunk["usage"] = None  # as OpenAI does: only the last chunk carries usage
    return chunk


def usage_chunk_body(head: CompletionHeader, done: DoneFrame) -> dict[str, Any]:
    return {
        "id": head.id,
        "object": "chat.completion.chunk",
        "created": head.created,
        "model": head.model,
        "choices": [],
        "usage": usage_body(done.usage),
        "system_fingerprint": None,
    }


def model_body(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "drivetrain"}


def models_body(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_body(model, created)]}
