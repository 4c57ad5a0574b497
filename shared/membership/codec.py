"""Sealing and opening datagrams: version, HMAC-SHA256 over the payload, and a named reason for every drop."""

from __future__ import annotations

import enum
import hashlib
import hmac

import msgspec

from shared.membership.messages import (
    PROTOCOL_VERSION,
    Body,
    Envelope,
    decode_envelope,
    encode,
)

MAC_SIZE = 32
# Larger than any datagram we send; anything bigger is not ours and not worth decoding.
MAX_DATAGRAM = 65_507


class Drop(enum.StrEnum):
    """Why a datagram (or one update inside it) was thrown away."""

    UNDECODABLE = "undecodable"  # not msgpack, truncated, or not the shape of our messages
    WRONG_VERSION = "wrong_version"
    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    UNKNOWN_CLUSTER = "unknown_cluster"
    REPLAYED = "replayed"  # sequence number already seen, or timestamp outside the window
    BAD_UPDATE = "bad_update"  # one piggybacked update or state record that did not decode


class Codec:
    """Turns an Envelope into a datagram `[version, payload, mac]` and back, checking everything but replay."""

    def __init__(self, cluster: str, secret: bytes, version: int = PROTOCOL_VERSION) -> None:
        self.cluster = cluster
        self.version = version
        self._secret = secret

    def mac(self, version: int, payload: bytes) -> bytes:
        # The version is signed too, so nobody can relabel a payload for a parser it was not meant for.
        return hmac.digest(self._secret, version.to_bytes(2, "big") + payload, hashlib.sha256)

    def seal(self, sender: str, seq: int, ts: float, body: Body) -> bytes:
        payload = encode(Envelope(self.cluster, sender, seq, ts, body))
        return encode_frame(self.version, payload, self.mac(self.version, payload))

    def open(self, data: bytes) -> Envelope | Drop:
        """The envelope, or why it was dropped. Never raises."""
        if len(data) > MAX_DATAGRAM:
            return Drop.UNDECODABLE
        try:
            frame = msgspec.msgpack.decode(data)
        except (msgspec.DecodeError, ValueError):
            return Drop.UNDECODABLE
        if not isinstance(frame, list) or not frame or not isinstance(frame[0], int):
            return Drop.UNDECODABLE
        if frame[0] != self.version:
            return Drop.WRONG_VERSION
        if len(frame) != 3 or not isinstance(frame[1], bytes):
            return Drop.UNDECODABLE
        payload, mac = frame[1], frame[2]
        if not mac:
            return Drop.UNSIGNED
        if not isinstance(mac, bytes) or not hmac.compare_digest(mac, self.mac(self.version, payload)):
            return Drop.BAD_SIGNATURE
        try:
            envelope = decode_envelope(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            return Drop.UNDECODABLE
        if envelope.cluster != self.cluster:
            return Drop.UNKNOWN_CLUSTER
        return envelope


def encode_frame(version: int, payload: bytes, mac: bytes | None) -> bytes:
    """The outer frame; tests use it to build unsigned or mislabelled datagrams."""
    return encode_any([version, payload, mac])


_plain = msgspec.msgpack.Encoder()


def encode_any(value: object) -> bytes:
    return _plain.encode(value)
