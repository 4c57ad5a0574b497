"""Authenticated envelopes for the records on Kafka: who sent a message, for which topic, and
an HMAC-SHA256 over both and the message under a key derived from the fleet secret.

Anyone who can write to a topic could otherwise speak for any edge or worker: forge tokens
into a stream, cancel someone else's chat. A sealed record names its sender, and a message
that claims a sender (a chat names its edge, a token batch its worker) must be sealed by it.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from shared import wire

MAC_BYTES = 32


class Sealed(msgspec.Struct, frozen=True, array_like=True):
    sender: str
    body: bytes
    mac: bytes


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over the parts, each prefixed by its length, so no two splits read alike."""
    digest = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        digest.update(len(part).to_bytes(4, "big") + part)
    return digest.digest()


def derive_key(secret: bytes, purpose: bytes) -> bytes:
    """One key per use of the fleet secret, so a MAC made for one never verifies as another."""
    return hmac.new(secret, b"drivetrain/" + purpose, hashlib.sha256).digest()


def claimed_sender(message: msgspec.Struct) -> str | None:
    """The member a message says it comes from, when it says."""
    if isinstance(message, (wire.ChatRequest, wire.Resume)):
        return message.edge_id
    if isinstance(message, (wire.TokenBatch, wire.KvEvents)):
        return message.worker_id
    if isinstance(message, wire.UsageRecord):
        return message.reporter
    return None


class Seal:
    """Seals this member's messages and opens the fleet's."""

    def __init__(self, secret: bytes, sender: str) -> None:
        if not secret:
            raise ValueError("sealing internal messages needs the fleet secret")
        self._key = derive_key(secret, b"record")
        self.sender = sender
        self._decoder = msgspec.msgpack.Decoder(Sealed)

    def _mac(self, channel: str, sender: str, body: bytes) -> bytes:
        return mac(self._key, channel.encode(), sender.encode(), body)

    def seal(self, channel: str, body: bytes) -> bytes:
        return msgspec.msgpack.encode(Sealed(self.sender, body, self._mac(channel, self.sender, body)))

    def open(self, channel: str, data: object) -> Sealed:
        """The envelope, verified; anything else raises WireError with the reason."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise wire.WireError(f"expected a sealed record, got {type(data).__name__}")
        try:
            sealed = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise wire.WireError(f"not a sealed record: {exc}") from exc
        if not hmac.compare_digest(sealed.mac, self._mac(channel, sealed.sender, sealed.body)):
            raise wire.WireError(f"bad seal (claims to be from {sealed.sender[:64]!r})")
        return sealed

    def encode(self, channel: str, message: msgspec.Struct) -> bytes:
        return self.seal(channel, wire.encode(message))

    def decode(self, channel: str, data: object, kind: type) -> tuple[str, msgspec.Struct]:
        """(sender, message): sealed by a fleet member, for this channel, by whom it claims."""
        sealed = self.open(channel, data)
        message = wire.decode(sealed.body, kind)
        claimed = claimed_sender(message)
        if claimed is not None and claimed != sealed.sender:
            raise wire.WireError(f"sealed by {sealed.sender[:64]!r} but claims to be from {claimed[:64]!r}")
        return sealed.sender, message
