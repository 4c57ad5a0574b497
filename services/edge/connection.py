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
from services.edge.tool_replies import ToolReply
from shared import wire
from shared.codes import ErrorCode

GOING_AWAY = 1001
GO_AWAY_FLUSH_S = 2.0  # for the frames already queued to reach a slow client


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
    tool_reply: ToolReply | None = None  # its reply is read for tool calls, which its done frame carries


@dataclass(frozen=True)
class Delivered:
    """What one routed event did: the events it let out, in order, or that it was a duplicate."""

    chat: Chat
    sent: list[wire.Event]
    duplicate: bool = False
    foreign: bool = False  # from a worker that does not run the stream: dropped


def may_speak(chat: Chat, event: wire.Event, worker_id: str) -> bool:
    if isinstance(event, wire.Started):
        return event.worker_id == worker_id and chat.owner in (None, worker_id)
    if isinstance(event, wire.HandedOff):  # only the owner may hand its stream on
        return chat.owner is not None and worker_id == chat.owner
    if chat.owner is None:
        return not isinstance(event, wire.Token)
    return worker_id == chat.owner


class Connection:
    def __init__(
        self,
        conn_id: str,
        tenant: str,
        sink: Callable[[EdgeFrame], Awaitable[None]],
        closer: Callable[[int, str], Awaitable[None]] | None = None,
        key_hash: str = "",
    ) -> None:
        self.conn_id = conn_id
        self.tenant = tenant
        self.key_hash = key_hash  # the key it proved itself with: when that is revoked, it is closed
        self._sink = sink
        self._closer = closer  # a WebSocket's close; None for an HTTP response
        self._outbox: asyncio.Queue[tuple[EdgeFrame, float] | None] = asyncio.Queue()  # (frame, queued at)
        self.on_written: Callable[[float], None] | None = None  # told each frame's seconds from queued to written
        self._written = asyncio.Event()  # the writer has ended
        self._by_chat: dict[str, Chat] = {}
        self._by_request: dict[str, Chat] = {}

    # Chats in flight -------------------------------------------------------------
    def has_chat(self, chat_id: str) -> bool:
        return chat_id in self._by_chat

    def chat(self, chat_id: str) -> Chat | None:
        return self._by_chat.get(chat_id)

    def num_chats(self) -> int:
        return len(self._by_chat)

    def request_ids(self) -> list[str]:
        return list(self._by_request)

    def open_chat(self, chat_id: str, request_id: str, next_seq: int = 0, epoch: int = 0, reads_tools: bool = False) -> None:
        """`reads_tools`: a chat that started here with tools; a resumed one has not seen its whole text."""
        chat = Chat(chat_id, request_id, epoch=epoch, tool_reply=ToolReply() if reads_tools else None)
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
        self._outbox.put_nowait((frame, time.perf_counter()))

    def deliver(self, event: wire.Event, worker_id: str | None = None) -> Delivered | None:
        """Queue a token-path event in seq order; None if it is for no chat of this connection.

        `worker_id` is the worker that sent it (None: the edge itself). Once a worker has started
        the stream, only that worker may add to it; before, any worker may end it (one that
        found it cancelled or quarantined it), but none may put tokens in it.
        """
        chat = self._by_request.get(event.request_id)
        if chat is None:
            return None
        if worker_id is not None and not may_speak(chat, event, worker_id):
            return Delivered(chat, [], foreign=True)
        chat.last_event_at = time.monotonic()
        if isinstance(event, (wire.Started, wire.HandedOff)):  # a handoff comes from the owner (may_speak)
            chat.owner = event.worker_id
            return Delivered(chat, [])
        if isinstance(event, wire.Moved):
            return self._moved(chat, event)
        duplicates = chat.order.num_duplicates
        ready = chat.order.push(event)
        for out in ready:
            frame = event_frame(chat.chat_id, out)
            self.send(chat.tool_reply.read(frame) if chat.tool_reply is not None else frame)
        if chat.order.finished:
            self.close_chat(event.request_id)
        return Delivered(chat, ready, duplicate=chat.order.num_duplicates > duplicates)

    def _moved(self, chat: Chat, moved: wire.Moved) -> Delivered:
        """Another socket resumed the stream: this one ends it, and leaves the stream (and its route) be."""
        if moved.epoch <= chat.epoch:
            return Delivered(chat, [])  # it moved here, or the notice is older than this attachment
        message = "this stream was resumed on another connection and goes on there"
        error = wire.Error.of(chat.request_id, ErrorCode.STREAM_MOVED, message)
        self.send(event_frame(chat.chat_id, error))
        self.close_chat(chat.request_id)
        return Delivered(chat, [error])

    async def run_writer(self) -> None:
        """Send queued frames until `close_writer`; a dead sink just ends the loop."""
        while (queued := await self._outbox.get()) is not None:
            frame, queued_at = queued
            try:
                await self._sink(frame)
            except (WebSocketDisconnect, RuntimeError, OSError):
                break
            if self.on_written is not None:
                self.on_written(time.perf_counter() - queued_at)
        with contextlib.suppress(asyncio.QueueEmpty):
            while True:
                self._outbox.get_nowait()
        self._written.set()

    def close_writer(self) -> None:
        self._outbox.put_nowait(None)

    async def go_away(self, timeout_s: float = GO_AWAY_FLUSH_S) -> None:
        """The edge is stopping: send what is queued, then close the socket with 1001 (going away)."""
        await self.shut(GOING_AWAY, "edge draining", timeout_s)

    async def shut(self, code: int, reason: str, timeout_s: float = GO_AWAY_FLUSH_S) -> None:
        """Send what is queued, then close the socket with this code (an HTTP stream has none)."""
        if self._closer is None:
            return
        self.close_writer()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._written.wait(), timeout_s)
        with contextlib.suppress(RuntimeError, OSError):
            await self._closer(code, reason)
