"""OpenAI's Responses API (/v1/responses), text only: the request we accept (as a ChatFrame), and the
response object and its stream events. Pure functions, no I/O; stored_responses.py looks up the
conversation a `previous_response_id` continues and stores each finished one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec

from services.edge.openai_schema import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    ApiError,
    CompletionHeader,
)
from services.edge.openai_text_events import (
    ParsedText,
    SseEvent,
    decode_checked,
)
from services.edge.protocol import (
    ChatFrame,
    ChatMessage,
    DoneFrame,
    LogprobBody,
    UsageBody,
)
from shared import wire
from shared.codes import FinishReason


class ContentPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer sent back as context
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    type: Literal["message"] = "message"
    id: str | None = None  # an earlier output item's, sent back as it came
    status: str | None = None

    def as_chat_message(self) -> ChatMessage:
        role = "system" if self.role == "developer" else self.role
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return ChatMessage(role=role, content=text)


class TextFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: str


class TextOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesStreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_obfuscation: bool | None = None  # we never pad events, so either value is honoured


class ResponsesRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str
    input: Annotated[str, msgspec.Meta(min_length=1)] | Annotated[list[InputMessage], msgspec.Meta(min_length=1)]
    instructions: str | None = None  # a system message before the input
    max_output_tokens: wire.MaxTokens | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    # Harmless: bookkeeping that does not change what is generated.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # absent or true: the answer is kept, for a later `previous_response_id`
    previous_response_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    truncation: str | None = None
    # Accepted only at their neutral value (see NEUTRAL).
    conversation: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    reasoning: Any = None
    include: list[Any] | None = None
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None


NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "conversation": lambda v: v is None,  # OpenAI's conversation objects: continue with previous_response_id
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none", "auto"),  # with no tools, "auto" calls none
    "reasoning": lambda v: v is None or (isinstance(v, dict) and not any(v.values())),  # {"effort": null}
    "include": lambda v: not v,
    "background": lambda v: not v,
    "prompt": lambda v: v is None,
    "top_logprobs": lambda v: not v,
    "max_tool_calls": lambda v: v is None,
    "truncation": lambda v: v in (None, "disabled"),
    "text": lambda v: v is None or ((v.format is None or v.format.type == "text") and v.verbosity in (None, "medium")),
}


def decode_responses_request(body: bytes, served_model: str) -> ResponsesRequest:
    """The body as a request we can honour; ApiError (400) when it is not one."""
    return decode_checked(_decoder, body, NEUTRAL, served_model)


def input_messages(request: ResponsesRequest) -> list[ChatMessage]:
    """This request's own input items as turns (the instructions are not among them)."""
    items = [InputMessage("user", request.input)] if isinstance(request.input, str) else request.input
    return [m.as_chat_message() for m in items]


def parse_responses_request(body: bytes, served_model: str, chat_id: str, head: CompletionHeader) -> ParsedText:
    """The body as a chat frame, with no earlier conversation; ApiError (400) when we cannot honour it."""
    return responses_text(decode_responses_request(body, served_model), chat_id, head)


def responses_text(
    request: ResponsesRequest, chat_id: str, head: CompletionHeader, history: Sequence[ChatMessage] = ()
) -> ParsedText:
    """The request as a chat frame: its instructions, then `history` (the stored conversation its
    `previous_response_id` continues), then its input."""
    messages = [*history, *input_messages(request)]
    if request.instructions:
        messages.insert(0, ChatMessage(role="system", content=request.instructions))
    temperature = DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
    top_p = DEFAULT_TOP_P if request.top_p is None else request.top_p
    limit = {"max_tokens": request.max_output_tokens} if request.max_output_tokens else {}
    frame = ChatFrame(
        type="chat", id=chat_id, messages=messages, temperature=temperature, top_p=top_p,
        conversation=request.prompt_cache_key or request.user, **limit,
    )  # fmt: skip
    echoed = {
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "temperature": temperature, "top_p": top_p, "user": request.user, "metadata": request.metadata or {},
        "store": request.store is not False, "previous_response_id": request.previous_response_id,
    }  # fmt: skip
    return ParsedText(frame, bool(request.stream), ResponsesRenderer(head, f"msg_{head.id[5:]}", echoed))


_decoder = msgspec.json.Decoder(ResponsesRequest)


def responses_usage(usage: UsageBody) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass
class ResponsesRenderer:
    """The `response` object and its stream: one message item holding one output_text part.

    `head.id` is the response id (`resp_…`); `echoed` the request's settings a response repeats.
    An answer cut by `max_output_tokens` is `incomplete`, as OpenAI's is.
    """

    head: CompletionHeader
    item_id: str
    echoed: dict[str, Any] = field(default_factory=dict)
    prompt_param: str = "input"
    _seq: int = 0
    _text: list[str] = field(default_factory=list)

    def body(self, text: str, done: DoneFrame, logprobs: Sequence[LogprobBody] = ()) -> dict[str, Any]:
        return self._response(text, done)  # `top_logprobs` is refused: no request here has logprobs

    def opening(self) -> list[SseEvent]:
        in_progress = self._response("", None)
        item = self._item("in_progress", [])
        return [
            self._event("response.created", response=in_progress),
            self._event("response.in_progress", response=in_progress),
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **self._at(), part=self._part("")),
        ]

    def token(self, text: str, logprobs: Sequence[LogprobBody] = ()) -> list[SseEvent]:
        self._text.append(text)
        return [self._event("response.output_text.delta", **self._at(), delta=text, logprobs=[])]

    def done(self, done: DoneFrame) -> list[SseEvent]:
        text = "".join(self._text)
        response = self._response(text, done)
        (item,) = response["output"]
        ending = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [
            self._event("response.output_text.done", **self._at(), text=text, logprobs=[]),
            self._event("response.content_part.done", **self._at(), part=self._part(text)),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event(ending, response=response),
        ]

    def failed(self, error: ApiError) -> list[SseEvent]:
        response = {**self._response("".join(self._text), None), "status": "failed"}
        response["error"] = {"code": error.code, "message": error.message}
        return [
            self._event("error", code=error.code, message=error.message, param=error.param),
            self._event("response.failed", response=response),
        ]

    def _event(self, type_: str, **fields: Any) -> SseEvent:
        event = SseEvent({"type": type_, "sequence_number": self._seq, **fields}, event=type_)
        self._seq += 1
        return event

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def _response(self, text: str, done: DoneFrame | None) -> dict[str, Any]:
        """The response object; `done` None: still in progress, with no output yet."""
        status, incomplete, output, usage = "in_progress", None, [], None
        if done is not None:
            cut = done.finish_reason is FinishReason.LENGTH
            status = "incomplete" if cut else "completed"
            incomplete = {"reason": "max_output_tokens"} if cut else None
            output = [self._item(status, [self._part(text)])]
            usage = responses_usage(done.usage)
        head = self.head
        return {
            "id": head.id, "object": "response", "created_at": head.created, "status": status, "error": None,
            "incomplete_details": incomplete, "model": head.model, "output": output, "parallel_tool_calls": False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
            "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [], "truncation": "disabled",
            "usage": usage, **self.echoed,
        }  # fmt: skip
