"""Highest-random-weight (rendezvous) hashing, shared by edges placing chats on workers and prefill
workers choosing decode workers."""

from __future__ import annotations

import hashlib


def rendezvous(key: str, member: str) -> int:
    """Each key ranks the members its own way, stable as members come and go, so a prefix nobody
    holds yet still lands on the same member every time (then warms it)."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{member}".encode(), digest_size=8).digest(), "big")
