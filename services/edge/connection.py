"""One client connection: its chats in flight, their stream order, and one writer that owns the output.

Events arrive from any router task; they are ordered per request synchronously and
queued as protocol frames, and a single writer task hands them to the connection's
sink (a WebSocket, or an HTTP event stream), so frames never interleave or reorder.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from starlette.websockets import WebSocketDisconnect

from services.edge.protocol import EdgeFrame, event_frame
from services.edge.stream_order import StreamOrder
from shared import wire


@dataclass
class Chat:
    chat_id: str
    request_id: str
    order: StreamOrder = field(default_factory=StreamOrder)
    owner: str | None = None  # the worker that started it, once it says so
    epoch: int = 0  # the route epoch: grows each time the stream is resumed
    opened_at: float = field(default_factory=time.monotonic)
    last_event_at: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None


@dataclass(frozen=True)
class Delivered:
    """What one routed event did: the events it let out, in order, or that it was a duplicate."""

    chat: Chat
    sent: list[wire.Event]
    duplicate: bool = False


class Connection:
    def __init__(self, conn_id: str, tenant: str, sink: Callable[[EdgeFrame], Awaitable[None]]) -> None:
        self.conn_id = conn_id
        self.tenant = tenant
        self._sink = sink
        self._outbox: asyncio.Queue[EdgeFrame | None] = asyncio.Queue()
        self._by_chat: dict[str, Chat] = {}
        self._by_request: dict[str, Chat] = {}

    # Chats in flight -------------------------------------------------------------
    def has_chat(self, chat_id: str) -> bool:
        return chat_id in self._by_chat

    def request_of(self, chat_id: str) -> str | None:
        chat = self._by_chat.get(chat_id)
        return chat.request_id if chat else None

    def num_chats(self) -> int:
        return len(self._by_chat)

    def request_ids(self) -> list[str]:
        return list(self._by_request)

    def open_chat(self, chat_id: str, request_id: str, next_seq: int = 0, epoch: int = 0) -> None:
        chat = Chat(chat_id, request_id, epoch=epoch)
        chat.order.next_seq = next_seq
        self._by_chat[chat_id] = chat
        self._by_request[request_id] = chat

    def chats(self) -> list[Chat]:
        return list(self._by_request.values())

    def close_chat(self, request_id: str) -> None:
        chat = self._by_request.pop(request_id, None)
        if chat is not None:
            self._by_chat.pop(chat.chat_id, None)

    # Outgoing frames ---------------------------------------------------------------
    def send(self, frame: EdgeFrame) -> None:
        self._outbox.put_nowait(frame)

    def deliver(self, event: wire.Event) -> Delivered | None:
        """Queue a token-path event in seq order; None if it is for no chat of this connection."""
        chat = self._by_request.get(event.request_id)
        if chat is None:
            return None
        chat.last_event_at = time.monotonic()
        if isinstance(event, wire.Started):
            chat.owner = event.worker_id
            return Delivered(chat, [])
        duplicates = chat.order.num_duplicates
        ready = chat.order.push(event)
        for out in ready:
            self._outbox.put_nowait(event_frame(chat.chat_id, out))
        if chat.order.finished:
            self.close_chat(event.request_id)
        return Delivered(chat, ready, duplicate=chat.order.num_duplicates > duplicates)

    async def run_writer(self) -> None:
        """Send queued frames until `close_writer`; a dead sink just ends the loop."""
        while (frame := await self._outbox.get()) is not None:
            try:
                await self._sink(frame)
            except (WebSocketDisconnect, RuntimeError, OSError):
                break
        with contextlib.suppress(asyncio.QueueEmpty):
            while True:
                self._outbox.get_nowait()

    def close_writer(self) -> None:
        self._outbox.put_nowait(None)
