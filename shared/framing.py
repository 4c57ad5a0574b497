"""Length-prefixed frames over an asyncio stream, and the handshake that opens the internal
router -> edge connection with them (the handshake's logic is in link_auth.py)."""

from __future__ import annotations

import asyncio
import struct

from shared.link_auth import (
    HANDSHAKE_MAX_BYTES,
    Accept,
    FrameMac,
    Hello,
    LinkKeys,
    Proof,
    decode,
    encode,
)

# A frame of routed events is split well below this (see the router's links); an edge never
# buffers more than this for one frame of an authenticated peer.
MAX_FRAME_BYTES = 4 * 1024 * 1024
_LENGTH = struct.Struct(">I")


class FrameTooLarge(ValueError):
    pass


def write_frame(writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(_LENGTH.pack(len(payload)) + payload)


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """The next frame; raises asyncio.IncompleteReadError when the peer closes."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > max_bytes:
        raise FrameTooLarge(f"frame of {length} bytes exceeds {max_bytes}")
    return await reader.readexactly(length)


async def accept_router(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keys: LinkKeys, edge_id: str, timeout_s: float
) -> tuple[str, FrameMac]:
    """Edge side: (router id, the session's frame MACs); raises LinkRefused, TimeoutError, or a read error."""
    hello = keys.hello(edge_id)
    write_frame(writer, encode(hello))
    await writer.drain()
    proof = decode(await asyncio.wait_for(read_frame(reader, HANDSHAKE_MAX_BYTES), timeout_s), Proof)
    write_frame(writer, encode(keys.check_proof(hello, proof)))
    await writer.drain()
    return proof.router_id, keys.session(hello, proof)


async def connect_edge(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keys: LinkKeys, router_id: str, edge_id: str,
    timeout_s: float,
) -> FrameMac:
    """Router side: the session's frame MACs once the edge proved to be `edge_id`; raises as above."""
    hello = decode(await asyncio.wait_for(read_frame(reader, HANDSHAKE_MAX_BYTES), timeout_s), Hello)
    proof = keys.prove(hello, router_id)
    write_frame(writer, encode(proof))
    await writer.drain()
    accept = decode(await asyncio.wait_for(read_frame(reader, HANDSHAKE_MAX_BYTES), timeout_s), Accept)
    keys.check_accept(hello, proof, accept, edge_id)
    return keys.session(hello, proof)
