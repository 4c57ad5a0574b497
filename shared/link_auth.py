"""The router -> edge link's handshake and frame MACs, as plain functions (the sockets are elsewhere).

At connect time both ends prove they hold the fleet secret and say who they are: the
edge sends a hello with a fresh nonce, the router a proof over it with a nonce of its
own, the edge a proof back. Every frame after carries a MAC under a key of that
session and a running count, so nothing can be injected into, reordered in or
replayed onto a link. (Privacy on a network that leaves the host is TLS's job.)
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import msgspec

from shared.seal import MAC_BYTES, derive_key, mac

NONCE_BYTES = 16
HANDSHAKE_MAX_BYTES = 1024  # a frame before the peer has proved itself can be no bigger


class LinkRefused(ValueError):
    """The peer could not prove it holds the fleet secret, or is not who we expected."""


class Hello(msgspec.Struct, frozen=True, array_like=True):
    """Edge -> router, first: who the edge is, and a challenge."""

    edge_id: str
    nonce: bytes


class Proof(msgspec.Struct, frozen=True, array_like=True):
    """Router -> edge: who the router is, its own challenge, and its answer to the edge's."""

    router_id: str
    nonce: bytes
    mac: bytes


class Accept(msgspec.Struct, frozen=True, array_like=True):
    """Edge -> router: the edge's answer to the router's challenge."""

    mac: bytes


class LinkKeys:
    """What one fleet secret gives the link: handshake proofs and each session's frame key."""

    def __init__(self, secret: bytes, purpose: bytes = b"link") -> None:
        """`purpose` keeps links of different kinds apart: a proof made for one is no use on another."""
        if not secret:
            raise ValueError("an internal link needs the fleet secret")
        self._key = derive_key(secret, purpose)

    def hello(self, edge_id: str) -> Hello:
        return Hello(edge_id, secrets.token_bytes(NONCE_BYTES))

    def prove(self, hello: Hello, router_id: str) -> Proof:
        nonce = secrets.token_bytes(NONCE_BYTES)
        return Proof(router_id, nonce, mac(self._key, b"router", hello.edge_id.encode(), hello.nonce, router_id.encode(), nonce))

    def check_proof(self, hello: Hello, proof: Proof) -> Accept:
        """Edge side: the router's proof checks out; the accept to send back."""
        expected = mac(self._key, b"router", hello.edge_id.encode(), hello.nonce, proof.router_id.encode(), proof.nonce)
        if len(proof.nonce) != NONCE_BYTES or not hmac.compare_digest(proof.mac, expected):
            raise LinkRefused("the router's proof does not match the fleet secret")
        return Accept(mac(self._key, b"edge", hello.edge_id.encode(), proof.nonce, hello.nonce))

    def check_accept(self, hello: Hello, proof: Proof, accept: Accept, expected_edge: str) -> None:
        """Router side: this is the edge we meant to reach, and it holds the secret."""
        if hello.edge_id != expected_edge:
            raise LinkRefused(f"expected edge {expected_edge}, reached {hello.edge_id[:64]!r}")
        if len(hello.nonce) != NONCE_BYTES:
            raise LinkRefused("malformed hello")
        expected = mac(self._key, b"edge", hello.edge_id.encode(), proof.nonce, hello.nonce)
        if not hmac.compare_digest(accept.mac, expected):
            raise LinkRefused("the edge's proof does not match the fleet secret")

    def session(self, hello: Hello, proof: Proof) -> FrameMac:
        return FrameMac(mac(self._key, b"session", hello.nonce, proof.nonce))


class FrameMac:
    """One session's frames: each is MAC || body, the MAC over its number in the session and the body."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._sent = 0
        self._received = 0

    def _mac(self, number: int, body: bytes | memoryview) -> bytes:
        return hmac.new(self._key, number.to_bytes(8, "big") + bytes(body), hashlib.sha256).digest()

    def seal(self, body: bytes) -> bytes:
        self._sent += 1
        return self._mac(self._sent, body) + body

    def open(self, frame: bytes) -> bytes:
        if len(frame) < MAC_BYTES:
            raise LinkRefused("frame shorter than its MAC")
        body = frame[MAC_BYTES:]
        if not hmac.compare_digest(frame[:MAC_BYTES], self._mac(self._received + 1, body)):
            raise LinkRefused("frame MAC does not match: injected, reordered or replayed")
        self._received += 1
        return body


def encode(message: Hello | Proof | Accept) -> bytes:
    return msgspec.msgpack.encode(message)


def decode(data: bytes, kind: type) -> Hello | Proof | Accept:
    try:
        return msgspec.msgpack.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LinkRefused(f"malformed handshake: {exc}") from exc
