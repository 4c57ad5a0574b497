"""The edge's HTTP surface on one port: the WebSocket chat endpoint, the OpenAI-compatible API,
the chat page, /healthz and /metrics.

Starlette routes under uvicorn, whose WebSocket protocol is the `websockets` library's.
"""

from __future__ import annotations

import asyncio
import uuid

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.edge.auth import authenticate, parse_api_keys
from services.edge.chat_page import chat_page_routes
from services.edge.connection import Connection
from services.edge.openai_api import openai_routes
from services.edge.protocol import EdgeFrame, encode_frame
from services.edge.service import EdgeService
from shared.codes import ErrorCode
from shared.health import health_route
from shared.status_server import metrics_route


def build_app(service: EdgeService) -> Starlette:
    api_keys = parse_api_keys(service.settings.api_keys)

    async def chat_socket(websocket: WebSocket) -> None:
        tenant = authenticate(api_keys, websocket.headers, websocket.query_params)
        if tenant is None:
            service.count_refusal(ErrorCode.INVALID_API_KEY, None)
            # Refused at the handshake with a real HTTP status, before any frame.
            await websocket.send_denial_response(
                PlainTextResponse("missing or unknown API key", status_code=401, headers={"WWW-Authenticate": "Bearer"})
            )
            return
        await websocket.accept()

        async def send_frame(frame: EdgeFrame) -> None:
            await websocket.send_text(encode_frame(frame))

        conn = Connection(uuid.uuid4().hex, tenant, send_frame)
        service.open_connection(conn)
        writer = asyncio.create_task(conn.run_writer())
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
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
            *openai_routes(service, api_keys),
            *chat_page_routes(),
        ]
    )
