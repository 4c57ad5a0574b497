"""OpenAI-compatible HTTP API on the edge's port: /v1/chat/completions and /v1/models.

Each completion is one `Connection` holding one chat, admitted and served by the same
EdgeService path as a WebSocket chat; a client that goes away closes it, which cancels
the request on its worker.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from services.edge.auth import authenticate
from services.edge.connection import Connection
from services.edge.openai_schema import (
    ApiError,
    CompletionHeader,
    ParsedCompletion,
    chunk_body,
    completion_body,
    finish_reason_of,
    model_body,
    models_body,
    parse_completion_request,
    refusal_error,
    usage_chunk_body,
)
from services.edge.openai_tools import delta_body
from services.edge.protocol import (
    AcceptedFrame,
    DoneFrame,
    EdgeFrame,
    ErrorFrame,
    LogprobBody,
    ProtocolError,
    TokenFrame,
)
from services.edge.service import EdgeService
from shared.codes import ErrorCode
from shared.models.tool_call_parser import ToolCallStream

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # a buffering proxy in front would hold tokens back
]


def openai_routes(service: EdgeService) -> list[BaseRoute]:
    model = service.settings.model
    started = int(time.time())

    def tenant_of(request: Request) -> str | None:
        # Header only: a key in a URL ends up in logs, and HTTP clients can always set headers.
        credential = authenticate(service.tenants.tenant_of, request.headers, {})
        return credential.tenant if credential is not None else None

    async def chat_completions(request: Request) -> Response:
        tenant = tenant_of(request)
        if tenant is None:
            service.count_refusal(ErrorCode.INVALID_API_KEY, None)
            return error_response(unauthorized(request))
        head = CompletionHeader(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model)
        try:
            body = await read_json_body(request, service.settings.max_frame_bytes)
            parsed = parse_completion_request(body, model, head.id)
        except ApiError as exc:
            service.count_refusal(exc.code or "invalid_request", tenant)
            return error_response(exc)
        return CompletionResponse(service, tenant, parsed, head)

    async def list_models(request: Request) -> Response:
        if tenant_of(request) is None:
            return error_response(unauthorized(request))
        return JSONResponse(models_body(model, started))

    async def get_model(request: Request) -> Response:
        if tenant_of(request) is None:
            return error_response(unauthorized(request))
        wanted = request.path_params["model"]
        if wanted != model:
            return error_response(
                ApiError(404, f"The model `{wanted}` does not exist", code="model_not_found", param="model")
            )
        return JSONResponse(model_body(model, started))

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    ]


def unauthorized(request: Request) -> ApiError:
    if request.headers.get("authorization"):
        message = "Incorrect API key provided"
    else:
        message = "You didn't provide an API key; send it as `Authorization: Bearer KEY`"
    return ApiError(401, message, code="invalid_api_key")


def error_response(error: ApiError, request_id: str | None = None) -> JSONResponse:
    headers = {}
    if error.status == 401:
        headers["www-authenticate"] = "Bearer"
    if error.retry_after is not None:
        headers["retry-after"] = str(error.retry_after)
    if request_id is not None:
        headers["x-request-id"] = request_id
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def read_json_body(request: Request, limit: int) -> bytes:
    """The body, refused before it is read in full when it is not JSON or too big."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(
            400, "Send the request body as JSON with `Content-Type: application/json`", code="invalid_content_type"
        )
    too_big = ApiError(413, f"The request body is over {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise ApiError(400, "The client went away while sending the body", code="client_disconnected") from exc
    return b"".join(chunks)


class HttpChat:
    """One chat on a connection of its own, whose frames land in a queue the response reads."""

    def __init__(self, service: EdgeService, tenant: str) -> None:
        self._service = service
        self._frames: asyncio.Queue[EdgeFrame] = asyncio.Queue()
        self.conn = Connection(uuid.uuid4().hex, tenant, self._frames.put)
        self._writer: asyncio.Task[None] | None = None
        self.chat_id = ""
        self.request_id: str | None = None

    async def open(self, parsed: ParsedCompletion) -> None:
        """Admit the chat; raises ProtocolError when the edge refuses it."""
        self.chat_id = parsed.frame.id
        self._service.open_connection(self.conn)
        self._writer = asyncio.create_task(self.conn.run_writer())
        await self._service.start_chat(self.conn, parsed.frame)
        accepted = await self._frames.get()  # queued by start_chat before it returned
        assert isinstance(accepted, AcceptedFrame)
        self.request_id = accepted.request_id

    async def next_frames(self) -> list[EdgeFrame]:
        """At least one frame, and all others already waiting, so a burst goes out in one write."""
        frames = [await self._frames.get()]
        while not self._frames.empty():
            frames.append(self._frames.get_nowait())
        return frames

    async def close(self) -> None:
        """Ends the connection; a chat that has not finished is cancelled on its worker at once."""
        if self._writer is None:
            return
        writer, self._writer = self._writer, None
        self.conn.close_writer()
        await writer  # it ends at the sentinel: its sink, a queue, never blocks
        # No HTTP client can resume a stream: an unfinished chat is cancelled at once.
        await self._service.close_connection(self.conn, grace=False)


class CompletionResponse:
    """Runs one admitted completion as an ASGI response: JSON when it ends, or server-sent events as it goes.

    The HTTP status waits for the chat's first event, so a refusal by the worker before
    any token still arrives as a proper error status; later errors are an SSE error event.
    """

    def __init__(self, service: EdgeService, tenant: str, parsed: ParsedCompletion, head: CompletionHeader) -> None:
        self._service = service
        self._tenant = tenant
        self._parsed = parsed
        self._head = head
        self._tools = ToolCallStream() if parsed.tool_calls else None
        self._wants_logprobs = parsed.frame.logprobs is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chat = HttpChat(self._service, self._tenant)
        try:
            try:
                await chat.open(self._parsed)
            except ProtocolError as exc:
                self._service.count_refusal(exc.code, self._tenant)
                await error_response(refusal_error(exc.code, exc.message, exc.retry_after_ms))(scope, receive, send)
                return
            serve = self._stream if self._parsed.stream else self._collect
            await run_until_disconnect(serve(chat, scope, receive, send), receive)
        finally:
            # Also on disconnect or shutdown: this is what frees the worker's capacity.
            await chat.close()

    async def _collect(self, chat: HttpChat, scope: Scope, receive: Receive, send: Send) -> None:
        pieces: list[str] = []
        logprobs: list[LogprobBody] | None = [] if self._wants_logprobs else None
        while True:
            for frame in await chat.next_frames():
                if isinstance(frame, TokenFrame):
                    pieces.append(frame.text)
                    if logprobs is not None:
                        logprobs.extend(frame.logprobs)
                    continue
                if isinstance(frame, DoneFrame):
                    body = completion_body(self._head, "".join(pieces), frame, self._parsed.tool_calls, logprobs)
                    response: Response = json_response(body, chat.request_id)
                elif isinstance(frame, ErrorFrame):
                    response = error_response(refusal_error(frame.code, frame.message), chat.request_id)
                else:
                    continue
                await response(scope, receive, send)
                return

    async def _stream(self, chat: HttpChat, scope: Scope, receive: Receive, send: Send) -> None:
        frames = await chat.next_frames()
        if isinstance(first := frames[0], ErrorFrame):
            await error_response(refusal_error(first.code, first.message), chat.request_id)(scope, receive, send)
            return
        headers = [*SSE_HEADERS, (b"x-request-id", (chat.request_id or "").encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        include_usage = self._parsed.include_usage
        events = [chunk_body(self._head, {"role": "assistant", "content": ""}, None, include_usage)]
        while True:
            end: EdgeFrame | None = None
            for frame in frames:
                events.extend(self._events_of(frame))
                if isinstance(frame, (DoneFrame, ErrorFrame)):
                    end = frame
                    break
            # A finished stream ends with OpenAI's `[DONE]` sentinel; an errored one does not.
            body = encode_events(events) + (b"data: [DONE]\n\n" if isinstance(end, DoneFrame) else b"")
            await send({"type": "http.response.body", "body": body, "more_body": end is None})
            if end is not None:
                return
            events = []
            frames = await chat.next_frames()

    def _events_of(self, frame: EdgeFrame) -> list[dict[str, Any]]:
        include_usage = self._parsed.include_usage
        if isinstance(frame, TokenFrame) and self._tools is not None:  # the text is read for tool calls
            return [chunk_body(self._head, delta_body(d), None, include_usage) for d in self._tools.feed(frame.text)]
        if isinstance(frame, TokenFrame):
            logprobs = frame.logprobs if self._wants_logprobs else None
            return [chunk_body(self._head, {"content": frame.text}, None, include_usage, logprobs)]
        if isinstance(frame, DoneFrame):
            held = self._tools.finish() if self._tools is not None else []
            rest = [chunk_body(self._head, delta_body(d), None, include_usage) for d in held]
            called = self._tools is not None and self._tools.num_calls > 0
            last = chunk_body(self._head, {}, finish_reason_of(frame.finish_reason, called), include_usage)
            return [*rest, last, usage_chunk_body(self._head, frame)] if include_usage else [*rest, last]
        if isinstance(frame, ErrorFrame):
            # Tokens already went out under a 200: the error travels as an event, as OpenAI's does.
            return [refusal_error(frame.code, frame.message).body()]
        return []


def json_response(body: dict[str, Any], request_id: str | None) -> Response:
    headers = {"x-request-id": request_id} if request_id else None
    return Response(msgspec.json.encode(body), media_type="application/json", headers=headers)


def encode_events(events: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + msgspec.json.encode(event) + b"\n\n" for event in events)


async def run_until_disconnect(work: Coroutine[Any, Any, None], receive: Receive) -> None:
    """Run `work`; if the client goes away first, cancel it and return."""
    working = asyncio.create_task(work)
    watching = asyncio.create_task(wait_for_disconnect(receive))
    try:
        await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watching, working):
            task.cancel()
        await asyncio.gather(watching, working, return_exceptions=True)
    if not working.cancelled() and (exc := working.exception()) is not None:
        raise exc


async def wait_for_disconnect(receive: Receive) -> None:
    # No timeout: the server answers `http.disconnect` when the client leaves or the
    # response completes, and the caller cancels this as soon as its work ends.
    while (await receive())["type"] != "http.disconnect":
        pass
