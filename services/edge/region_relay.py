"""One client connection's relay to a peer region's edge: a WebSocket client that sends the
client's chats there, as that tenant, and hands every frame back under the client's chat id.

The peer serves a relayed chat with its whole pipeline (its workers, routers, deadlines), so
this side only carries frames. Each direction is a delay line: a frame leaves `delay_s` after
it was handed over, in order, so an added delay delays every frame and never slows the flow.
A socket that breaks ends each of its chats at once with a retryable error: `unavailable` when
the peer had not accepted it yet, `worker_lost` when it had (the region serving it is gone).
An `accepted` frame carries a resume token that matches no stream: a relayed stream is never
resumed (a `resume` anywhere is refused with `resume_refused`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from services.edge.protocol import (
    AcceptedFrame,
    ChatFrame,
    DoneFrame,
    EdgeFrame,
    ErrorFrame,
)
from services.edge.region_settings import RegionPeer
from shared.codes import ErrorCode

log = logging.getLogger(__name__)

RELAYED_HEADER = "x-drivetrain-relayed-from"  # names the sending region: chats on such a socket are never relayed again
OPEN_TIMEOUT_S = 3.0  # the client's frames wait while the relay opens: kept short, and the chat stays here if it fails
PING_S = 5.0  # a peer that stops answering pings for this long twice over counts as broken
CLOSE_TIMEOUT_S = 2.0
MAX_PEER_FRAME_BYTES = 4 * 1024 * 1024  # a done frame with tool calls is the largest; far under this
_BROKEN = object()  # in the inbound line: the socket ended
_CLOSE = object()  # in the outbound line: close once what is before it went out


class RelayUnavailable(Exception):
    """The peer's edge could not be reached or refused the handshake; nothing was sent."""


@dataclass
class RelayedChat:
    accepted: bool = False  # the peer sent `accepted`: a worker there may have produced tokens
    cancelling: bool = False  # a cancel went out and its answer has not come back


_frames = msgspec.json.Decoder(EdgeFrame)


class RelayLink:
    def __init__(
        self,
        peer: RegionPeer,
        ws: ClientConnection,
        deliver: Callable[[EdgeFrame], None],
        delay_s: float,
        on_ended: Callable[[RelayLink, int], None],
        on_bad_frame: Callable[[], None],
    ) -> None:
        self.peer = peer
        self._ws = ws
        self._deliver = deliver
        self._delay_s = delay_s
        self._on_ended = on_ended  # (link, chats it still had): it is of no more use
        self._on_bad_frame = on_bad_frame
        self._chats: dict[str, RelayedChat] = {}
        self._inbound: asyncio.Queue[tuple[float, Any]] = asyncio.Queue()
        self._outbound: asyncio.Queue[tuple[float, Any]] = asyncio.Queue()
        self._closing = False
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._release()), asyncio.create_task(self._send())]

    @classmethod
    async def open(cls, peer: RegionPeer, api_key: str, here: str, **kwargs: Any) -> RelayLink:
        """Connects as the tenant (its own API key); raises RelayUnavailable."""
        headers = {"Authorization": f"Bearer {api_key}", RELAYED_HEADER: here}
        try:
            ws = await connect(
                peer.edge_url, additional_headers=headers, open_timeout=OPEN_TIMEOUT_S, ping_interval=PING_S,
                ping_timeout=PING_S, close_timeout=CLOSE_TIMEOUT_S, max_size=MAX_PEER_FRAME_BYTES, compression=None,
            )  # fmt: skip
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise RelayUnavailable(f"{peer.edge_url}: {exc!r}") from exc
        return cls(peer, ws, **kwargs)

    # Chats -----------------------------------------------------------------------------
    def holds(self, chat_id: str) -> bool:
        return chat_id in self._chats

    def num_chats(self) -> int:
        return len(self._chats)

    @property
    def usable(self) -> bool:
        return not self._closing and not self._tasks[0].done()

    def start(self, frame: ChatFrame) -> None:
        self._chats[frame.id] = RelayedChat()
        self._put_out(chat_text(frame))

    def cancel(self, chat_id: str) -> None:
        self._chats[chat_id].cancelling = True
        self._put_out(msgspec.json.encode({"type": "cancel", "id": chat_id}).decode())

    def close(self) -> None:
        """The client is gone: cancel its chats there (none can be resumed), then close the socket."""
        if self._closing:
            return
        for chat_id in list(self._chats):
            self.cancel(chat_id)
        self._closing = True
        self._put_out(_CLOSE)

    async def wait_closed(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def abort(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await self.wait_closed()
        with contextlib.suppress(Exception):
            await self._ws.close()

    def _put_out(self, item: Any) -> None:
        self._outbound.put_nowait((time.monotonic() + self._delay_s, item))

    # The two delay lines -------------------------------------------------------------
    async def _send(self) -> None:
        try:
            while True:
                due, item = await self._outbound.get()
                await _until(due)
                if item is _CLOSE:
                    await self._ws.close()
                    return
                await self._ws.send(item)
        except (ConnectionClosed, OSError):
            pass  # the reader sees the socket end and fails what was in flight

    async def _read(self) -> None:
        try:
            async for text in self._ws:
                self._inbound.put_nowait((time.monotonic() + self._delay_s, text))
        except (ConnectionClosed, OSError):
            pass
        finally:
            self._inbound.put_nowait((time.monotonic(), _BROKEN))

    async def _release(self) -> None:
        while True:
            due, item = await self._inbound.get()
            await _until(due)
            if item is _BROKEN:
                self._ended()
                return
            self._handle(item)

    # Frames from the peer ----------------------------------------------------------
    def _handle(self, text: str | bytes) -> None:
        if self._closing:
            return  # the client is gone: the answers to its cancels have nowhere to go
        try:
            frame = _frames.decode(text)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._on_bad_frame()
            log.warning("dropped a frame from region %s that is not the protocol's: %s", self.peer.name, exc)
            return
        if frame.id is None:  # about none of its chats: a frame it could not read
            log.warning("region %s refused a relayed frame: %s", self.peer.name, getattr(frame, "message", frame))
            return
        chat = self._chats.get(frame.id)
        if chat is None:
            return  # for a chat that ended here (an answer to a late cancel)
        if isinstance(frame, AcceptedFrame):
            chat.accepted = True
            frame = AcceptedFrame(frame.id, frame.request_id, secrets.token_urlsafe(24))  # matches no stream
        elif isinstance(frame, ErrorFrame) and chat.cancelling and frame.code is ErrorCode.UNAVAILABLE:
            chat.cancelling = False  # "cannot cancel now; retry": the chat goes on, as it would here
        elif isinstance(frame, (DoneFrame, ErrorFrame)):
            del self._chats[frame.id]
        self._deliver(frame)

    def _ended(self) -> None:
        """The socket is gone: each chat still in flight ends now, with a retryable error."""
        chats, self._chats = self._chats, {}
        self._outbound.put_nowait((0.0, _CLOSE))  # the sender ends too
        if not self._closing:
            for chat_id, chat in chats.items():
                self._deliver(_lost(chat_id, chat, self.peer.name))
        self._on_ended(self, 0 if self._closing else len(chats))


def chat_text(frame: ChatFrame) -> str:
    """The chat frame as a client would send it: a field at its default is left out, as a client leaves
    it out (some defaults, such as `min_tokens` 0, are not values a client may send)."""
    raw = {}
    for info in msgspec.structs.fields(frame):
        value = getattr(frame, info.name)
        if info.required or value != (info.default_factory() if info.default is msgspec.NODEFAULT else info.default):
            raw[info.encode_name] = value
    return msgspec.json.encode(raw).decode()


def _lost(chat_id: str, chat: RelayedChat, region: str) -> ErrorFrame:
    if chat.accepted:
        code, message = ErrorCode.WORKER_LOST, f"region {region}, which served this chat, is out of reach; retry the request"
    else:
        code, message = ErrorCode.UNAVAILABLE, f"region {region} could not take this chat now; retry"
    return ErrorFrame(chat_id, code, message, code.retryable)


async def _until(due: float) -> None:
    if (wait := due - time.monotonic()) > 0:
        await asyncio.sleep(wait)
