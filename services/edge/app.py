"""The edge's HTTP surface on one port: the WebSocket chat endpoint, the OpenAI-compatible API,
the chat page, /healthz and /metrics.

Starlette routes under uvicorn, whose WebSocket protocol is the `websockets` library's.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.edge.chat_page import chat_page_routes
from services.edge.connection import Connection
from services.edge.handshake import Admission, HandshakeGate, Refusal, admit_all
from services.edge.openai_api import openai_routes
from services.edge.openai_text_api import text_routes
from services.edge.origins import OriginPolicy
from services.edge.protocol import EdgeFrame, encode_frame
from services.edge.service import EdgeService
from shared.codes import ErrorCode
from shared.health import health_route
from shared.rate_limits import LogThrottle, Rate, TokenBucket, held_back
from shared.status_server import metrics_route

log = logging.getLogger(__name__)

FRAME_RATE_CLOSE = 1008  # policy violation
REFUSAL_LOG_RATE = Rate(per_s=1.0, burst=10)  # a flood of refusals must not become a flood of log lines


def build_app(service: EdgeService, admission: Admission = admit_all) -> Starlette:
    limits = service.settings.clients
    gate = HandshakeGate(
        service.tenants.tenant_of,
        OriginPolicy.parse(limits.allowed_origins),
        Rate(limits.refused_handshakes_per_s, limits.refused_handshakes_burst),
        admission,
    )
    frame_rate = Rate(limits.frames_per_s, limits.frames_burst)
    refusal_log = LogThrottle(REFUSAL_LOG_RATE, time.monotonic())

    def note_refusal(client: str, code: ErrorCode, what: str) -> None:
        if (held := refusal_log.admit(time.monotonic())) is not None:
            log.info("refused %s from %s: %s%s", what, client, code, held_back(held))

    async def chat_socket(websocket: WebSocket) -> None:
        client = websocket.client.host if websocket.client else "unknown"
        now = time.monotonic()
        admitted = gate.admit(client, websocket.headers, websocket.query_params, websocket.url.scheme == "wss", now)
        if isinstance(admitted, Refusal):
            service.count_refusal(admitted.code, None)
            note_refusal(client, admitted.code, "a chat socket")
            # Refused at the handshake with a real HTTP status, before any frame.
            await websocket.send_denial_response(
                PlainTextResponse(admitted.reason, status_code=admitted.status, headers=admitted.headers)
            )
            return
        tenant = admitted.tenant
        if service.draining:
            service.count_refusal(ErrorCode.EDGE_DRAINING, tenant)
            await websocket.send_denial_response(
                PlainTextResponse("this edge is stopping; connect to another", status_code=503, headers={"Retry-After": "1"})
            )
            return
        conn_id = uuid.uuid4().hex
        # The tenant's connection cap, over every edge: the slot is given back by close_connection.
        if (capped := await service.tenancy.admit_socket(tenant, conn_id)) is not None:
            service.count_refusal(capped.code, tenant)
            await websocket.send_denial_response(
                PlainTextResponse(capped.reason, status_code=capped.status, headers=capped.headers)
            )
            return
        try:
            await websocket.accept()
        except BaseException:
            await service.tenancy.end_socket(conn_id)
            raise

        async def send_frame(frame: EdgeFrame) -> None:
            await websocket.send_text(encode_frame(frame))

        conn = Connection(
            conn_id, tenant, send_frame, closer=lambda code, reason: websocket.close(code, reason),
            key_hash=admitted.key_hash,
        )
        service.open_connection(conn)
        service.regions.opened(conn_id, websocket.headers, websocket.query_params)  # its chats may be relayed as it
        writer = asyncio.create_task(conn.run_writer())
        frames = TokenBucket(frame_rate, time.monotonic())
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                if not frames.take(time.monotonic()):
                    service.count_refusal(ErrorCode.FRAME_RATE_EXCEEDED, tenant)
                    note_refusal(client, ErrorCode.FRAME_RATE_EXCEEDED, f"frames of tenant {tenant}")
                    await websocket.close(FRAME_RATE_CLOSE, "too many frames; slow down")
                    break
                await service.handle_frame(conn, message.get("text") or message.get("bytes") or b"")
        except WebSocketDisconnect:
            pass
        finally:
            conn.close_writer()
            await service.close_connection(conn)
            await writer

    return Starlette(
        routes=[
            WebSocketRoute("/v1/chat", chat_socket),
            health_route(service.health),
            metrics_route(service.registry),
            *openai_routes(service),
            *text_routes(service),  # /v1/completions, /v1/responses
            *chat_page_routes(),
        ]
    )
