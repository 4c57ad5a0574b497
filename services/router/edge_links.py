"""Persistent, authenticated connections from a router to each edge, reconnecting when one drops."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from shared import wire
from shared.framing import MAX_FRAME_BYTES, connect_edge, write_frame
from shared.link_auth import FrameMac, LinkKeys
from shared.seal import MAC_BYTES

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0  # for the TCP connect, then again for the handshake
SEND_ATTEMPTS = 5
RETRY_DELAY_S = 0.2


class EdgeUnreachable(ConnectionError):
    pass


def forward_frames(
    deliveries: list[wire.Delivery], max_bytes: int = MAX_FRAME_BYTES - MAC_BYTES, sent_at: float = 0.0
) -> list[bytes]:
    """The deliveries as ForwardBatch frames, in order, each within the link's frame limit."""
    payload = wire.encode(wire.ForwardBatch(deliveries, sent_at=sent_at))
    if len(payload) <= max_bytes or len(deliveries) <= 1:
        return [payload]  # one delivery never outgrows a frame: a token batch record is far smaller
    half = len(deliveries) // 2
    return forward_frames(deliveries[:half], max_bytes, sent_at) + forward_frames(deliveries[half:], max_bytes, sent_at)


class EdgeLink:
    def __init__(self, edge_id: str, address: tuple[str, int], keys: LinkKeys, router_id: str) -> None:
        self.edge_id = edge_id
        self.address = address
        self._keys = keys
        self._router_id = router_id
        self._writer: asyncio.StreamWriter | None = None
        self._frames: FrameMac | None = None
        self._lock = asyncio.Lock()

    async def send(self, payload: bytes, attempts: int | None = None) -> None:
        """Write one frame, reconnecting and retrying a few times before giving up."""
        async with self._lock:
            for attempt in range(attempts or SEND_ATTEMPTS):
                try:
                    writer, frames = await self._connected()
                    write_frame(writer, frames.seal(payload))
                    await writer.drain()
                    return
                except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:  # ValueError: LinkRefused, FrameTooLarge
                    log.warning("edge %s at %s: %s (attempt %d)", self.edge_id, self.address, exc, attempt + 1)
                    await self._drop()
                    await asyncio.sleep(RETRY_DELAY_S * (attempt + 1))
            raise EdgeUnreachable(f"edge {self.edge_id} at {self.address} unreachable")

    async def _connected(self) -> tuple[asyncio.StreamWriter, FrameMac]:
        if self._writer is None or self._frames is None or self._writer.is_closing():
            await self._drop()
            host, port = self.address
            reader, self._writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
            self._frames = await connect_edge(
                reader, self._writer, self._keys, self._router_id, self.edge_id, CONNECT_TIMEOUT_S
            )
        return self._writer, self._frames

    async def _drop(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
            self._writer = None
        self._frames = None

    async def close(self) -> None:
        async with self._lock:
            await self._drop()
