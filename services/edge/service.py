"""The edge service: admits chats from sockets to Kafka and puts routed tokens back on them.

A chat is checked here (frame, prompt length) before anything is written anywhere;
then its route goes to the Redis Cluster, `accepted` to the client, and the request
to Kafka. Tokens come back from routers over the internal link as `ForwardBatch`es.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any

from aiokafka import AIOKafkaProducer
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from services.edge.config import EdgeConfig
from services.edge.connection import Connection
from services.edge.prompt_limit import PromptLimit
from services.edge.protocol import (
    CancelFrame,
    ChatFrame,
    ProtocolError,
    accepted_frame,
    error_frame,
    parse_client_frame,
)
from shared import wire
from shared.framing import read_frame
from shared.routing_map import Route, RoutingMap

log = logging.getLogger(__name__)


class EdgeService:
    def __init__(
        self,
        config: EdgeConfig,
        producer: AIOKafkaProducer,
        redis: RedisCluster,
        prompt_limit: PromptLimit,
    ) -> None:
        self.config = config
        self.topics = config.topics
        self._producer = producer
        self._routes = RoutingMap(redis)
        self._prompt_limit = prompt_limit
        self._connections: dict[str, Connection] = {}
        self._background: set[asyncio.Task] = set()

    # Client side ---------------------------------------------------------------------
    def open_connection(self, conn: Connection) -> None:
        self._connections[conn.conn_id] = conn

    async def close_connection(self, conn: Connection) -> None:
        """The socket is gone: its unfinished requests are cancelled on the workers."""
        self._connections.pop(conn.conn_id, None)
        request_ids = conn.request_ids()
        if request_ids:
            await self._cancel(request_ids)

    async def handle_frame(self, conn: Connection, text: str | bytes) -> None:
        try:
            frame = parse_client_frame(text)
            if isinstance(frame, ChatFrame):
                await self.start_chat(conn, frame)
            elif isinstance(frame, CancelFrame):
                await self.cancel_chat(conn, frame.id)
        except ProtocolError as exc:
            conn.send(error_frame(exc.chat_id, exc.code, exc.message, exc.retryable))

    async def start_chat(self, conn: Connection, frame: ChatFrame) -> None:
        """Admit a chat for any kind of connection; raises ProtocolError when refused."""
        if conn.has_chat(frame.id):
            raise ProtocolError("duplicate_id", f"chat id {frame.id!r} is already in flight on this socket", frame.id)
        if conn.num_chats() >= self.config.max_chats_per_connection:
            limit = self.config.max_chats_per_connection
            raise ProtocolError("too_many_chats", f"at most {limit} chats in flight per socket", frame.id, True)
        messages = [{"role": m.role, "content": m.content} for m in frame.messages]
        if (reason := self._prompt_limit.excess(messages)) is not None:
            raise ProtocolError("prompt_too_long", reason, frame.id)
        request_id = uuid.uuid4().hex
        request = wire.ChatRequest(
            request_id=request_id,
            edge_id=self.config.edge_id,
            conn_id=conn.conn_id,
            tenant=conn.tenant,
            messages=[wire.Message(m.role, m.content) for m in frame.messages],
            max_tokens=frame.max_tokens,
            temperature=frame.temperature,
            top_p=frame.top_p,
            seed=frame.seed,
            created_at=time.time(),
        )
        conn.open_chat(frame.id, request_id)
        try:
            await self._routes.put(request_id, Route(self.config.edge_id, conn.conn_id), conn.tenant)
            # Accepted goes out before the request can reach a worker, so it precedes every token.
            conn.send(accepted_frame(frame.id, request_id))
            await self._producer.send_and_wait(self.topics.requests, wire.encode(request), key=request_id.encode())
        except Exception as exc:  # noqa: BLE001 - any infrastructure failure becomes a retryable error
            log.warning("could not admit chat %s: %r", request_id, exc)
            conn.close_chat(request_id)
            raise ProtocolError("unavailable", "the service could not take this chat now; retry", frame.id, True) from exc

    async def cancel_chat(self, conn: Connection, chat_id: str) -> None:
        request_id = conn.request_of(chat_id)
        if request_id is None:
            raise ProtocolError("unknown_id", f"no chat {chat_id!r} in flight on this socket", chat_id)
        # The worker answers with `done` (finish_reason "cancelled") on the token path.
        await self._cancel([request_id])

    async def _cancel(self, request_ids: list[str]) -> None:
        await self._producer.send_and_wait(self.topics.control, wire.encode(wire.Cancel(request_ids)))

    # Router side ---------------------------------------------------------------------
    async def serve_router(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One router's persistent link: frames of deliveries until it closes."""
        try:
            while True:
                payload = await read_frame(reader)
                try:
                    batch = wire.decode(payload, wire.ForwardBatch)
                except wire.WireError as exc:
                    log.warning("dropping a malformed frame from a router: %s", exc)
                    continue
                self.deliver(batch.deliveries)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def deliver(self, deliveries: list[wire.Delivery]) -> None:
        for delivery in deliveries:
            conn = self._connections.get(delivery.conn_id)
            if conn is not None and conn.deliver(delivery.event):
                self._spawn(self._forget_route(delivery.event.request_id))

    async def _forget_route(self, request_id: str) -> None:
        try:
            await self._routes.delete(request_id)
        except (RedisError, OSError) as exc:
            log.debug("route of %s left to expire: %r", request_id, exc)  # it has a TTL

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def aclose(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
