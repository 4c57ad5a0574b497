"""Every message of the membership wire: piggybacked updates, full-state records and packet bodies (msgpack via msgspec)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.membership.member import Status

PROTOCOL_VERSION = 1

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Meta = dict[str, str]
LoadMap = dict[str, int | float]
Blobs = list[bytes]


# Updates are encoded one by one and carried as opaque byte strings, so a packet can be
# filled to an exact size and one malformed update never spoils the rest.
class Alive(msgspec.Struct, frozen=True, array_like=True, tag="a"):
    """The member is alive at this incarnation, with this address and meta."""

    member: Name
    incarnation: Count
    role: str
    host: str
    port: Port
    addresses: Meta
    load: LoadMap
    pid: Count


class Suspect(msgspec.Struct, frozen=True, array_like=True, tag="s"):
    """`by` failed to reach the member at this incarnation."""

    member: Name
    incarnation: Count
    by: Name


class Dead(msgspec.Struct, frozen=True, array_like=True, tag="d"):
    """`by` let a suspicion of the member run out."""

    member: Name
    incarnation: Count
    by: Name


class Left(msgspec.Struct, frozen=True, array_like=True, tag="l"):
    """The member said goodbye itself."""

    member: Name
    incarnation: Count


Update = Alive | Suspect | Dead | Left


class StateRecord(msgspec.Struct, frozen=True, array_like=True):
    """One member's full entry, for push/pull and for `members` answers."""

    member: Name
    incarnation: Count
    status: Status
    role: str
    host: str
    port: Port
    addresses: Meta
    load: LoadMap
    pid: Count


class Ping(msgspec.Struct, frozen=True, array_like=True, tag="ping"):
    """`view` is the sender's digest of who is active; a target that differs swaps full state."""

    probe: Count
    target: Name
    view: Count
    updates: Blobs


class PingReq(msgspec.Struct, frozen=True, array_like=True, tag="preq"):
    """Please ping `target` at host:port for me and pass its ack back."""

    probe: Count
    target: Name
    host: str
    port: Port
    updates: Blobs


class Ack(msgspec.Struct, frozen=True, array_like=True, tag="ack"):
    probe: Count
    updates: Blobs


class Nack(msgspec.Struct, frozen=True, array_like=True, tag="nack"):
    """An indirect prober heard nothing from the target: proof that the asker's own links work."""

    probe: Count
    updates: Blobs


class Gossip(msgspec.Struct, frozen=True, array_like=True, tag="gsp"):
    updates: Blobs


class Sync(msgspec.Struct, frozen=True, array_like=True, tag="sync"):
    """One datagram of a full-state push; a request asks for the receiver's state back."""

    request: bool
    states: Blobs


class MembersRequest(msgspec.Struct, frozen=True, array_like=True, tag="mreq"):
    request_id: Count


class MembersResponse(msgspec.Struct, frozen=True, array_like=True, tag="mres"):
    request_id: Count
    index: Count
    total: Count
    states: Blobs


Body = Ping | PingReq | Ack | Nack | Gossip | Sync | MembersRequest | MembersResponse
PIGGYBACKING = (Ping, PingReq, Ack, Nack, Gossip)


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    """The signed payload of every datagram."""

    cluster: str
    sender: Name
    seq: Count
    ts: float
    body: Body


_update_decoder = msgspec.msgpack.Decoder(Update)
_record_decoder = msgspec.msgpack.Decoder(StateRecord)
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_update(blob: bytes) -> Update:
    """Raises msgspec.DecodeError (a ValueError) on anything malformed."""
    return _update_decoder.decode(blob)


def decode_record(blob: bytes) -> StateRecord:
    return _record_decoder.decode(blob)


def decode_envelope(blob: bytes) -> Envelope:
    return _envelope_decoder.decode(blob)
