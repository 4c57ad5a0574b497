"""The KV link: a direct, authenticated worker -> worker connection that hands one prefilled
request, KV cache and all, from a prefill worker to a decode worker. Not Kafka: a 1k-token
prompt of an 8B model is 128 MiB of KV.

One request per connection, in this order (the sender's messages left, the receiver's right):

    handshake (shared/framing.py, under the fleet secret; the receiver listens)
    Offer: the request, its tokens, the layout     ->
                                                   <-  Reserved(have_blocks) | Refused(reason)
    LayerKV x num_layers: blocks have_blocks..     ->  (each written into the reserved blocks)
    Sent(checksum of every layer's bytes)          ->
                                                   <-  Received | Refused
    (the sender puts HandedOff on the token path, so the edge takes the receiver's tokens)
    Commit(the stream's edge and epoch now)        ->
                                                   <-  Committed

Any failure before Commit leaves the request with the sender, which decodes it itself; the
receiver frees what it reserved. Every frame is MAC'd (link_auth.py): nothing can be injected.
"""

from __future__ import annotations

import asyncio

import msgspec

from shared import wire
from shared.framing import FrameTooLarge, read_frame, write_frame
from shared.link_auth import FrameMac, LinkRefused

KV_LINK_PURPOSE = b"kv-link"  # its handshake keys differ from the router -> edge link's
CONTROL_MAX_BYTES = 8 * 1024 * 1024  # an offer carries a whole prompt's token ids and the request


class KVLinkError(Exception):
    """The peer broke the protocol, refused, or went away: this handoff is off."""


class Layout(msgspec.Struct, frozen=True, array_like=True):
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str


class Offer(msgspec.Struct, frozen=True, tag="offer"):
    request: wire.ChatRequest
    prompt_token_ids: list[wire.TokenId]
    output_token_ids: list[wire.TokenId]  # sampled by the sender; their text is in `events`
    cached_tokens: wire.Count  # of the prompt, from the sender's prefix cache (the usage reports them)
    layout: Layout
    block_ids: list[int]  # the sender's blocks, in position order: one per block_size prompt tokens
    edge_id: str  # where the stream goes, for the receiver to end it if the sender vanishes mid-commit
    epoch: int
    events: list[wire.Event]  # what the stream has said so far (its seq goes on from there)
    v: int = wire.WIRE_VERSION


class Reserved(msgspec.Struct, frozen=True, tag="reserved"):
    have_blocks: int  # leading blocks the receiver's prefix cache holds already: not sent


class Refused(msgspec.Struct, frozen=True, tag="refused"):
    reason: str


class LayerKV(msgspec.Struct, frozen=True, tag="layer"):
    layer: int
    k: bytes
    v: bytes


class Sent(msgspec.Struct, frozen=True, tag="sent"):
    checksum: bytes  # blake2b over every layer's k then v, in layer order


class Received(msgspec.Struct, frozen=True, tag="received"):
    pass


class Commit(msgspec.Struct, frozen=True, tag="commit"):
    edge_id: str  # a resume may have moved the stream since the offer
    epoch: int


class Committed(msgspec.Struct, frozen=True, tag="committed"):
    pass


Message = Offer | Reserved | Refused | LayerKV | Sent | Received | Commit | Committed
_decoder = msgspec.msgpack.Decoder(Message)
_encoder = msgspec.msgpack.Encoder()


class KVLinkConnection:
    """One authenticated connection: typed messages in MAC'd, length-prefixed frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frames: FrameMac, peer: str) -> None:
        self._reader = reader
        self._writer = writer
        self._frames = frames
        self.peer = peer

    async def send(self, message: Message) -> None:
        write_frame(self._writer, self._frames.seal(_encoder.encode(message)))
        await self._writer.drain()

    async def receive(self, kind: type, max_bytes: int = CONTROL_MAX_BYTES) -> Message:
        """The next message, which must be a `kind`; a Refused or anything else raises KVLinkError."""
        try:
            body = self._frames.open(await read_frame(self._reader, max_bytes))
            message = _decoder.decode(body)
        except (LinkRefused, FrameTooLarge, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise KVLinkError(f"bad frame from {self.peer[:64]}: {exc}") from exc
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise KVLinkError(f"{self.peer[:64]} closed the link") from exc
        if isinstance(message, Refused) and kind is not Refused:
            raise KVLinkError(f"{self.peer[:64]} refused: {message.reason[:200]}")
        if not isinstance(message, kind):
            raise KVLinkError(f"expected {kind.__name__} from {self.peer[:64]}, got {type(message).__name__}")
        return message

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass
