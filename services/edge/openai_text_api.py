"""/v1/completions and /v1/responses on the edge's port: each request one chat, admitted by the same
`EdgeService.start_chat` as every other, answered by the endpoint's renderer (JSON, or events as it goes)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from services.edge.auth import authenticate
from services.edge.openai_api import (
    SSE_HEADERS,
    HttpChat,
    error_response,
    json_response,
    read_json_body,
    run_until_disconnect,
    unauthorized,
)
from services.edge.openai_completions_schema import parse_completions_request
from services.edge.openai_schema import ApiError, CompletionHeader, refusal_error
from services.edge.openai_text_events import ParsedText, encode_events
from services.edge.protocol import (
    DoneFrame,
    EdgeFrame,
    ErrorFrame,
    LogprobBody,
    ProtocolError,
    TokenFrame,
)
from services.edge.service import EdgeService
from services.edge.stored_responses import StoredResponses
from shared.codes import ErrorCode

# (body, served model, chat id, header, tenant) -> the request; ApiError when it cannot be honoured.
Parse = Callable[[bytes, str, str, CompletionHeader, str], Awaitable[ParsedText]]


def text_routes(service: EdgeService) -> list[BaseRoute]:
    stored = StoredResponses(service.responses)  # previous_response_id: the Redis Cluster, per tenant
    return [
        Route("/v1/completions", _endpoint(service, "cmpl-", _completions), methods=["POST"]),
        Route("/v1/responses", _endpoint(service, "resp_", stored.parse), methods=["POST"]),
    ]


async def _completions(body: bytes, model: str, chat_id: str, head: CompletionHeader, tenant: str) -> ParsedText:
    return parse_completions_request(body, model, chat_id, head)  # nothing stored: the tenant plays no part


def _endpoint(service: EdgeService, id_prefix: str, parse: Parse) -> Callable[[Request], object]:
    model = service.settings.model

    async def endpoint(request: Request) -> Response | TextResponse:
        credential = authenticate(service.tenants.tenant_of, request.headers, {})  # header only, as chat's
        if credential is None:
            service.count_refusal(ErrorCode.INVALID_API_KEY, None)
            return error_response(unauthorized(request))
        tenant = credential.tenant
        head = CompletionHeader(f"{id_prefix}{uuid.uuid4().hex}", int(time.time()), model)
        try:
            body = await read_json_body(request, service.settings.max_frame_bytes)
            parsed = await parse(body, model, head.id, head, tenant)
        except ApiError as exc:
            service.count_refusal(exc.code or "invalid_request", tenant)
            return error_response(exc)
        return TextResponse(service, tenant, parsed)

    return endpoint


class TextResponse:
    """One admitted request as an ASGI response. The status waits for the chat's first event, so a
    refusal before any token is a proper error status; a failure after it is the renderer's events."""

    def __init__(self, service: EdgeService, tenant: str, parsed: ParsedText) -> None:
        self._service = service
        self._tenant = tenant
        self._parsed = parsed
        self._render = parsed.renderer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chat = HttpChat(self._service, self._tenant)
        try:
            try:
                await chat.open(self._parsed)  # type: ignore[arg-type]  # it reads `.frame` only
            except ProtocolError as exc:
                self._service.count_refusal(exc.code, self._tenant)
                await error_response(self._error(exc.code, exc.message, exc.retry_after_ms))(scope, receive, send)
                return
            serve = self._stream if self._parsed.stream else self._collect
            await run_until_disconnect(serve(chat, scope, receive, send), receive)
        finally:
            await chat.close()  # also on disconnect: this is what frees the worker's capacity

    async def _finish(self, text: str, done: DoneFrame) -> None:
        if self._parsed.finished is not None:
            await self._parsed.finished(text, done)

    def _error(self, code: ErrorCode, message: str, retry_after_ms: int | None = None) -> ApiError:
        error = refusal_error(code, message, retry_after_ms)
        if error.param == "messages":  # a prompt too long: name this endpoint's prompt field
            error.param = self._render.prompt_param
        return error

    async def _collect(self, chat: HttpChat, scope: Scope, receive: Receive, send: Send) -> None:
        pieces: list[str] = []
        logprobs: list[LogprobBody] = []  # empty unless the request asked for them
        while True:
            for frame in await chat.next_frames():
                if isinstance(frame, TokenFrame):
                    pieces.append(frame.text)
                    logprobs.extend(frame.logprobs)
                elif isinstance(frame, DoneFrame):
                    body = self._render.body("".join(pieces), frame, logprobs)
                    await self._finish("".join(pieces), frame)
                    await json_response(body, chat.request_id)(scope, receive, send)
                    return
                elif isinstance(frame, ErrorFrame):
                    error = self._error(frame.code, frame.message)
                    await error_response(error, chat.request_id)(scope, receive, send)
                    return

    async def _stream(self, chat: HttpChat, scope: Scope, receive: Receive, send: Send) -> None:
        frames = await chat.next_frames()
        if isinstance(first := frames[0], ErrorFrame):
            await error_response(self._error(first.code, first.message), chat.request_id)(scope, receive, send)
            return
        headers = [*SSE_HEADERS, (b"x-request-id", (chat.request_id or "").encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        events = self._render.opening()
        pieces: list[str] = []
        while True:
            end: EdgeFrame | None = None
            for frame in frames:
                if isinstance(frame, TokenFrame):
                    pieces.append(frame.text)
                    events.extend(self._render.token(frame.text, frame.logprobs))
                elif isinstance(frame, DoneFrame):
                    events.extend(self._render.done(frame))
                    await self._finish("".join(pieces), frame)
                    end = frame
                elif isinstance(frame, ErrorFrame):
                    events.extend(self._render.failed(self._error(frame.code, frame.message)))
                    end = frame
                if end is not None:
                    break
            await send({"type": "http.response.body", "body": encode_events(events), "more_body": end is None})
            if end is not None:
                return
            events = []
            frames = await chat.next_frames()
