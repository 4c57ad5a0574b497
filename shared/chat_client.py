"""The client side of the chat protocol: a socket that runs many chats at once.

`ChatSocket` routes incoming frames to each chat's queue by `id`, so tests, benchmarks and
`drivetrain chat` (shared/chat_terminal.py) all read one chat's frames in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed


@dataclass
class ChatResult:
    """Everything one chat received, with arrival times (time.perf_counter)."""

    frames: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)

    @property
    def tokens(self) -> list[dict[str, Any]]:
        return [f for f in self.frames if f["type"] == "token"]

    @property
    def text(self) -> str:
        return "".join(f["text"] for f in self.tokens)

    @property
    def final(self) -> dict[str, Any] | None:
        return next((f for f in self.frames if f["type"] in ("done", "error")), None)


class ChatSocket:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self._queues: dict[str | None, asyncio.Queue[tuple[dict[str, Any], float]]] = defaultdict(asyncio.Queue)
        self._reader = asyncio.create_task(self._read())
        self.close_code: int | None = None

    @classmethod
    async def open(cls, url: str, api_key: str | None = "dev-key", **kwargs: Any) -> ChatSocket:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        ws = await connect(url, additional_headers=headers, max_size=None, open_timeout=10, **kwargs)
        return cls(ws)

    async def _read(self) -> None:
        try:
            async for text in self.ws:
                frame = json.loads(text)
                self._queues[frame.get("id")].put_nowait((frame, time.perf_counter()))
        except ConnectionClosed:
            pass
        finally:
            self.close_code = self.ws.close_code
            for queue in list(self._queues.values()):
                queue.put_nowait(({"type": "closed"}, time.perf_counter()))

    async def send(self, frame: dict[str, Any] | str) -> None:
        await self.ws.send(frame if isinstance(frame, str) else json.dumps(frame))

    async def chat(self, chat_id: str, text: str, **params: Any) -> None:
        await self.send({"type": "chat", "id": chat_id, "messages": [{"role": "user", "content": text}], **params})

    async def next_frame(self, chat_id: str | None, timeout: float = 30.0) -> dict[str, Any]:
        frame, _ = await asyncio.wait_for(self._queues[chat_id].get(), timeout)
        return frame

    async def collect(self, chat_id: str, timeout: float = 60.0) -> ChatResult:
        """Frames of one chat up to and including its `done` or `error` (or the socket closing)."""
        result = ChatResult()
        deadline = time.monotonic() + timeout
        while True:
            frame, arrival = await asyncio.wait_for(self._queues[chat_id].get(), max(0.01, deadline - time.monotonic()))
            result.arrivals.append(arrival)
            result.frames.append(frame)
            if frame["type"] in ("done", "error", "closed"):
                return result

    async def close(self) -> None:
        await self.ws.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
