"""Fixed-size KV blocks: ref counts, the free queue (whose order is the eviction order), prefix hashes.

Block 0 is reserved as the null block: it is never handed out, so a model runner
may point padding rows (e.g. of a captured CUDA graph) at it without harming
anyone's KV. A pool of N blocks therefore holds N - 1 usable blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

# The hashes are shared/models' (edges compute them too); re-exported as the engine's names.
from shared.models.block_hash import (
    BlockHash,
    hash_block_tokens,
    hash_full_blocks,
    salted_root,
)

__all__ = [
    "BlockHash",
    "BlockPool",
    "KVBlock",
    "KVCacheListener",
    "hash_block_tokens",
    "hash_full_blocks",
    "salted_root",
]

NULL_BLOCK_ID = 0


class KVCacheListener(Protocol):
    """Told what enters and leaves the prefix cache (by block hash value), on the engine's thread;
    it must only take note (the worker publishes the notes as KV-cache events)."""

    def block_stored(self, value: bytes) -> None: ...

    def block_evicted(self, value: bytes) -> None: ...

    def cache_cleared(self) -> None: ...


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the prefix cache (full blocks only).
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns every KV block; hands them out, takes them back, and keeps the prefix cache.

    A free block may still hold cached KV. The free queue runs from "evict first"
    (head) to "evict last" (tail): allocation pops the head, dropping that block's
    cache entry. Freed cached blocks go to the tail, so free cached blocks are
    evicted least-recently-used first; freed blocks without a hash hold nothing
    worth keeping and go to the head, so they are reused before any cached block.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # never reaches 0, so never freed or handed out
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks[1:]
        )
        self.cached_blocks: dict[bytes, KVBlock] = {}
        self.num_evicted_blocks = 0
        self.listener: KVCacheListener | None = None  # KV-cache events for cache-aware placement

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting their cached KV."""
        if not self.can_allocate(num_blocks):
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block holding this prefix's KV, or None. Does not take a reference."""
        block = self.cached_blocks.get(block_hash.value)
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits; a hit on a free block takes it off the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its hash; False if nothing was registered.

        When another block already holds the same prefix (two requests computed it
        at once), the first stays canonical and this one stays uncached.
        """
        if not self.enable_caching or block.block_hash is not None:
            return False
        if len(block_hash.token_ids) != self.block_size:
            raise ValueError(f"only full blocks are cached: got {len(block_hash.token_ids)} tokens")
        if block_hash.value in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash.value] = block
        if self.listener is not None:
            self.listener.block_stored(block_hash.value)
        return True

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the order given (callers pass tail blocks first)."""
        for block in blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise ValueError(f"block {block.block_id} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            self.free_queue[block.block_id] = block
            if block.block_hash is None:
                self.free_queue.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their KV but are no longer shared)."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        if self.listener is not None:
            self.listener.cache_cleared()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached_blocks[block.block_hash.value]
        if self.listener is not None:
            self.listener.block_evicted(block.block_hash.value)
        block.block_hash = None
        self.num_evicted_blocks += 1
