"""Per-request block tables over the BlockPool: prefix-cache lookup, all-or-nothing allocation, freeing."""

from __future__ import annotations

from collections.abc import Sequence

from services.worker.engine.block_pool import (
    BlockHash,
    BlockPool,
    KVBlock,
    hash_block_tokens,
)
from services.worker.engine.block_tables import BlockTables
from services.worker.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request to the blocks that hold its KV, in position order.

    Blocks enter the prefix cache only after their KV has been computed
    (`cache_blocks`, called once a step has run), never when they are allocated,
    so a hit can never read a block that is still being written.
    """

    def __init__(self, block_pool: BlockPool, max_model_len: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_pool.block_size
        self.max_model_len = max_model_len
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # The same tables as block ids, a row each: what every step's batch reads.
        self.block_tables = BlockTables(cdiv(max_model_len, self.block_size))
        self.req_to_row: dict[str, int] = {}
        # How many of a request's leading blocks are already registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_hit_rate(self) -> float:
        if self.num_prefix_queries_tokens == 0:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_queries_tokens

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks, and the number of tokens it covers.

        The last token is never served from cache: it must be computed so the model
        produces logits to sample from. Takes no references; pass the blocks to
        `allocate_slots` in the same scheduling step.
        """
        if not self.block_pool.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_hit_blocks)
        hits: list[KVBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def fit_one_more(self, requests: list[Request]) -> list[bool]:
        """Whether each request's next token fits in the blocks it holds, as it does in most decode
        steps: one call for the batch, where allocate_slots would be one call per request."""
        block_size, max_len, blocks_of = self.block_size, self.max_model_len, self.req_to_blocks
        return [
            r.num_computed_tokens < min(len(blocks_of.get(r.request_id, ())) * block_size, max_len) for r in requests
        ]

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; the ids of the blocks added, or None.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks`, placed
        right after the request's `num_computed_tokens`. All or nothing: on None the
        pool and the request are exactly as they were.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks and not new_computed_blocks:  # most decode steps: the token fits in the last block
            num_total = request.num_computed_tokens + num_new_tokens
            if num_total <= len(blocks) * self.block_size and num_total <= self.max_model_len:
                return []
        if blocks is None:
            blocks = []
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        if num_total > self.max_model_len:
            raise ValueError(
                f"request {request.request_id} would hold {num_total} tokens, "
                f"max_model_len is {self.max_model_len}"
            )
        num_new_blocks = max(0, self.num_blocks_for(num_total) - len(blocks) - len(new_computed_blocks))
        # Hits on free blocks leave the free queue when touched, so they are not
        # available to satisfy the new blocks as well.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if not self.block_pool.can_allocate(num_new_blocks + num_free_hits):
            return None

        if request.request_id not in self.req_to_blocks:
            self._count_prefix_query(request, len(new_computed_blocks))
            self.req_to_blocks[request.request_id] = blocks
            self.req_to_row[request.request_id] = self.block_tables.add_row()
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.allocate(num_new_blocks)
        blocks.extend(new_blocks)
        new_block_ids = [block.block_id for block in new_blocks]
        row = self.req_to_row[request.request_id]
        self.block_tables.append(row, [block.block_id for block in new_computed_blocks] + new_block_ids)
        return new_block_ids

    def cache_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is computed and whose tokens are all known
        (a step in flight may have computed a pending token's KV: its block waits for the token)."""
        if not self.block_pool.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return
        num_known = min(request.num_computed_tokens, len(request.all_token_ids))
        num_full = min(num_known // self.block_size, len(blocks))
        start = self.num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for index in range(start, num_full):
            self.block_pool.cache_full_block(blocks[index], hashes[index])
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its tail is evicted before its head."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        if (row := self.req_to_row.pop(request.request_id, None)) is not None:
            self.block_tables.release(row)
        self.block_pool.free_blocks(reversed(blocks))

    def block_row(self, request: Request) -> int:
        """The request's row of `block_tables.array` (it holds blocks: allocate_slots ran for it)."""
        return self.req_to_row[request.request_id]

    def get_block_ids(self, request: Request) -> list[int]:
        """A copy of the request's block table (block ids in position order)."""
        row = self.req_to_row.get(request.request_id)
        return [] if row is None else self.block_tables.block_ids(row)

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's chained block hashes, extended (and kept on it) to `num_blocks` blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else request.cache_root
            hashes.append(hash_block_tokens(parent, request.all_token_ids[start : start + bs]))
        return hashes

    def _count_prefix_query(self, request: Request, num_hit_blocks: int) -> None:
        # Counted at a request's first admission only: the counters describe prompt
        # reuse across requests, not recomputation after a preemption, and a request
        # that waits several steps is not counted once per step.
        if self.block_pool.enable_caching and request.num_preemptions == 0:
            self.num_prefix_queries_tokens += request.num_tokens
            self.num_prefix_hit_tokens += num_hit_blocks * self.block_size
