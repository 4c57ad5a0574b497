"""OpenAI chat-completion shapes on the edge: the request we accept (as a ChatFrame), the bodies and errors we send.

Pure functions, no I/O; `openai_api` wires them to HTTP.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from services.edge.openai_tools import reply_message
from services.edge.protocol import (
    NESTED_TOO_DEEPLY,
    ChatFrame,
    ChatMessage,
    DoneFrame,
    LogprobBody,
    UsageBody,
)
from services.edge.structured_request import (
    ResponseFormat,
    StructuredOutputs,
    ToolCallFrame,
    ToolChoice,
    ToolSpec,
    parses_tool_calls,
    request_grammar,
)
from shared import wire
from shared.codes import ErrorCode, FinishReason, clipped
from shared.models.structured import InvalidGrammar

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
        self.message = clipped(message)
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
    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn that only called tools
    name: str | None = None  # accepted and ignored: the chat template has no place for it
    tool_calls: list[ToolCallFrame] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    refusal: str | None = None  # accepted and ignored, as OpenAI returns it on assistant turns

    def as_chat_message(self) -> ChatMessage:
        role = "system" if self.role == "developer" else self.role
        content = self.content or ""
        text = content if isinstance(content, str) else "\n".join(p.text for p in content)
        calls, answers = self.tool_calls or [], self.tool_call_id or ""
        return ChatMessage(role=role, content=text, tool_calls=calls, tool_call_id=answers)


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # we never pad chunks, so either value is honoured


PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class SamplingFields(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The sampling fields every generating endpoint takes: OpenAI's, then vLLM's extras."""

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    seed: wire.Seed | None = None
    presence_penalty: wire.Penalty | None = None
    frequency_penalty: wire.Penalty | None = None
    logit_bias: wire.LogitBias | None = None
    stop: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | wire.StopStrings | None = None
    user: str | None = None  # keeps a user's requests on one worker, as the chat frame's `conversation` does
    priority: wire.Priority | None = None  # among the tenant's own waiting requests, lower first
    top_k: wire.TopK | None = None
    min_tokens: wire.MaxTokens | Literal[0] | None = None
    repetition_penalty: wire.RepetitionPenalty | None = None
    ignore_eos: bool | None = None
    stop_token_ids: wire.StopTokenIds | None = None


def sampling_controls(request: SamplingFields) -> dict[str, Any]:
    """The chat frame's fields for those the request set (the rest keep the frame's defaults), and
    OpenAI's defaults of temperature and top_p, which are not the chat protocol's."""
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    given = {
        "temperature": DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
        "top_p": DEFAULT_TOP_P if request.top_p is None else request.top_p, "seed": request.seed, "stop": stop,
        "frequency_penalty": request.frequency_penalty, "presence_penalty": request.presence_penalty,
        "logit_bias": request.logit_bias, "priority": request.priority, "top_k": request.top_k,
        "min_tokens": request.min_tokens, "repetition_penalty": request.repetition_penalty,
        "ignore_eos": request.ignore_eos, "stop_token_ids": request.stop_token_ids,
    }  # fmt: skip
    return {name: value for name, value in given.items() if value is not None}


class CompletionRequest(SamplingFields, frozen=True, forbid_unknown_fields=True, kw_only=True):
    model: str
    messages: Annotated[list[InputMessage], msgspec.Meta(min_length=1)]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: wire.MaxTokens | None = None
    max_completion_tokens: wire.MaxTokens | None = None
    n: PositiveInt | None = None
    # Harmless: bookkeeping that does not change what is generated (prompt_cache_key, else user,
    # keeps a conversation on one worker, as the chat frame's `conversation` does).
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Structured output and tools (structured_request.py); structured_outputs is vLLM's extension.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Accepted only at their neutral value (see NEUTRAL); anything else we cannot honour.
    logprobs: bool | None = None
    top_logprobs: wire.TopLogprobs | None = None  # needs logprobs: true
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
    "modalities": lambda v: v is None or v == ["text"],
    "functions": lambda v: not v,  # OpenAI's legacy form of tools: send `tools` instead
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
    tool_calls: bool = False  # the reply is read for tool calls


_decoder = msgspec.json.Decoder(CompletionRequest)
_AT_PATH = re.compile(r" - at `(?:key` in `)?\$\.?(?P<path>[^`]*)`$")  # a dict key's reason names its dict
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`")
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<field>[^`]*)`")


T = TypeVar("T")


def decode_body(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    """The body as the endpoint's request type; ApiError (400) naming the field when it is not one."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from exc
    except RecursionError as exc:  # msgspec stops at the interpreter's recursion limit
        message = f"We could not parse the JSON body of your request: {NESTED_TOO_DEEPLY}"
        raise ApiError(400, message, code="invalid_json") from exc



def parse_completion_request(body: bytes, served_model: str, chat_id: str) -> ParsedCompletion:
    """The request body as a chat frame for `EdgeService.start_chat`; ApiError (400) when we cannot honour it."""
    request = decode_body(_decoder, body)
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
    if request.top_logprobs is not None and not request.logprobs:
        raise ApiError(400, "`top_logprobs` needs `logprobs` to be true", code="invalid_value", param="top_logprobs")
    cap = request.max_completion_tokens or request.max_tokens
    limit = {"max_tokens": cap} if cap else {}
    frame = ChatFrame(
        type="chat",
        id=chat_id,
        messages=[m.as_chat_message() for m in request.messages],
        conversation=request.prompt_cache_key or request.user,  # what OpenAI routes its cache by
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        **limit,
        **sampling_controls(request),
        **_structured(request),
    )
    try:
        request_grammar(frame)  # refused here with its param; the edge's own check finds it cached
    except InvalidGrammar as exc:
        param = "tool_choice" if request.tool_choice not in (None, "none", "auto") else "response_format"
        raise ApiError(400, f"Invalid schema: {exc}", code="invalid_schema", param=param) from exc
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return ParsedCompletion(frame, bool(request.stream), include_usage, parses_tool_calls(frame))


def _structured(request: CompletionRequest) -> dict[str, Any]:
    given = {
        "response_format": request.response_format, "structured_outputs": request.structured_outputs,
        "tools": request.tools, "tool_choice": request.tool_choice, "parallel_tool_calls": request.parallel_tool_calls,
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
    ErrorCode.INVALID_SCHEMA: (400, "invalid_request_error", "invalid_schema"),
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
    param = {ErrorCode.PROMPT_TOO_LONG: "messages", ErrorCode.INVALID_SCHEMA: "response_format"}.get(code)
    retry_after = None
    if status in (429, 503):
        retry_after = -(-retry_after_ms // 1000) if retry_after_ms else RETRY_AFTER_S
    return ApiError(status, message, type_, api_code, param, retry_after)


# Responses ---------------------------------------------------------------------------------
# OpenAI has no "cancelled": a client only cancels by going away, and then reads nothing;
# a cancel it did not cause (say, an operator's) ended the answer early, which "stop" tells
# every client that knows the documented values. Unknown reasons fall back to "stop" too.
_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "stop"}


def finish_reason_of(reason: FinishReason, called_tools: bool = False) -> str:
    """OpenAI's word; a reply that ended in tool calls ends with "tool_calls", unless it was cut short."""
    if called_tools and reason is FinishReason.STOP:
        return "tool_calls"
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


def logprobs_body(logprobs: list[LogprobBody] | None) -> dict[str, Any] | None:
    """OpenAI's `logprobs` of a choice or a chunk: None when the request did not ask."""
    if logprobs is None:
        return None

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, p) for t, p in lp.top_logprobs]} for lp in logprobs],
        "refusal": None,
    }


def completion_body(
    head: CompletionHeader, text: str, done: DoneFrame, tool_calls: bool = False, logprobs: list[LogprobBody] | None = None
) -> dict[str, Any]:
    message, called = reply_message(text, tool_calls)
    return {
        "id": head.id,
        "object": "chat.completion",
        "created": head.created,
        "model": head.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs_body(logprobs),
                "finish_reason": finish_reason_of(done.finish_reason, called),
            }
        ],
        "usage": usage_body(done.usage),
        "system_fingerprint": None,
    }


def chunk_body(
    head: CompletionHeader,
    delta: dict[str, str],
    finish_reason: str | None,
    include_usage: bool,
    logprobs: list[LogprobBody] | None = None,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": head.id,
        "object": "chat.completion.chunk",
        "created": head.created,
        "model": head.model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs_body(logprobs), "finish_reason": finish_reason}],
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
