"""The edge's HTTP surface: the WebSocket chat endpoint and a health check, on one port.

Starlette routes under uvicorn (whose WebSocket protocol is the `websockets`
library's), so streaming HTTP endpoints can share the port later.
"""

from __future__ import annotations

import asyncio
import uuid

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.edge.auth import authenticate, parse_api_keys
from services.edge.chat_page import chat_page_routes
from services.edge.connection import Connection
from services.edge.openai_api import openai_routes
from services.edge.protocol import encode_frame
from services.edge.service import EdgeService


def build_app(service: EdgeService) -> Starlette:
    api_keys = parse_api_keys(service.config.api_keys)

    async def chat_socket(websocket: WebSocket) -> None:
        tenant = authenticate(api_keys, websocket.headers, websocket.query_params)
        if tenant is None:
            service.count_refusal("invalid_api_key", None)
            # Refused at the handshake with a real HTTP status, before any frame.
            await websocket.send_denial_response(
                PlainTextResponse("missing or unknown API key", status_code=401, headers={"WWW-Authenticate": "Bearer"})
            )
            return
        await websocket.accept()
        async def send_frame(frame: dict) -> None:
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

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "edge_id": service.config.edge_id})

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[
            WebSocketRoute("/v1/chat", chat_socket),
            Route("/healthz", health),
            Route("/metrics", metrics),
            *openai_routes(service, api_keys),
            *chat_page_routes(),
        ]
    )
