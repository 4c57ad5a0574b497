"""Length-prefixed frames over an asyncio stream: the internal router -> edge connection."""

from __future__ import annotations

import asyncio
import struct

MAX_FRAME_BYTES = 64 * 1024 * 1024
_LENGTH = struct.Struct(">I")


class FrameTooLarge(ValueError):
    pass


def write_frame(writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(_LENGTH.pack(len(payload)) + payload)


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """The next frame; raises asyncio.IncompleteReadError when the peer closes."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return await reader.readexactly(length)
