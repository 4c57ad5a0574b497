"""The prefix cache's chained block hashes, torch-free: the engine keys its cache by them, and edges
compute the same hashes of a prompt to find the worker that already holds its blocks.

A block's hash names the whole prefix up to and including that block; the first block's parent
is the request's cache salt (cache_salt.py), so prompts under different salts never share one.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NamedTuple


class BlockHash(NamedTuple):
    """A full block's identity in the prefix cache.

    `value` is sha256(parent value || the block's tokens as little-endian int64), so it
    names the whole prefix up to and including this block, and is stable across
    processes and machines. The tokens ride along so a hit is re-checked against
    them: a collision (or a forged value) can never serve another prefix's KV.
    """

    value: bytes
    token_ids: tuple[int, ...]


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    # The root parent is empty bytes; every other parent is 32 bytes, so no
    # (parent, tokens) pair can encode like another.
    digest = hashlib.sha256(parent.value if parent is not None else b"")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return BlockHash(digest.digest(), tuple(token_ids))


def salted_root(salt: str) -> BlockHash | None:
    """The parent of a request's first block: its cache salt, so prompts under different salts
    never share a block (no salt: the one shared root)."""
    if not salt:
        return None
    return BlockHash(hashlib.sha256(b"drivetrain/cache-salt/" + salt.encode()).digest(), ())


def hash_full_blocks(token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (a partial tail block has none)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def block_key(value: bytes) -> int:
    """A block hash as the key KV-cache events carry: the first 63 bits of its value (msgpack's and
    msgspec's signed 64-bit integers hold it).

    A placement hint only: two prefixes sharing a key can at worst misplace a request, never
    serve it the wrong KV (the engine re-checks the tokens of every hit)."""
    return int.from_bytes(value[:8], "big") >> 1
