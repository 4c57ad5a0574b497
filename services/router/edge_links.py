"""Persistent connections from a router to each edge, reconnecting when one drops."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from shared.framing import write_frame

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
SEND_ATTEMPTS = 5
RETRY_DELAY_S = 0.2


class EdgeUnreachable(ConnectionError):
    pass


class EdgeLink:
    def __init__(self, edge_id: str, address: tuple[str, int]) -> None:
        self.edge_id = edge_id
        self.address = address
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()

    async def send(self, payload: bytes, attempts: int | None = None) -> None:
        """Write one frame, reconnecting and retrying a few times before giving up."""
        async with self._lock:
            for attempt in range(attempts or SEND_ATTEMPTS):
                try:
                    writer = await self._connected()
                    write_frame(writer, payload)
                    await writer.drain()
                    return
                except (OSError, asyncio.TimeoutError) as exc:
                    log.warning("edge %s at %s: %s (attempt %d)", self.edge_id, self.address, exc, attempt + 1)
                    await self._drop()
                    await asyncio.sleep(RETRY_DELAY_S * (attempt + 1))
            raise EdgeUnreachable(f"edge {self.edge_id} at {self.address} unreachable")

    async def _connected(self) -> asyncio.StreamWriter:
        if self._writer is None or self._writer.is_closing():
            host, port = self.address
            _, self._writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
        return self._writer

    async def _drop(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
            self._writer = None

    async def close(self) -> None:
        async with self._lock:
            await self._drop()
