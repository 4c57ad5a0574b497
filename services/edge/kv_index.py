"""What each worker holds in its prefix cache, as its KV-cache events tell: block keys per worker,
in bounded memory. Pure; fed by the kv-events consumer (kv_events.py), read by placement.

The index is a hint. An edge started late, a lost record or a block dropped here for room makes
it miss blocks a worker holds (a cache hit given up), and an eviction not yet heard makes it
credit a block no longer there (a chat placed for nothing); neither can give a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared import wire


@dataclass
class WorkerBlocks:
    block_size: int
    keys: OrderedDict[int, None] = field(default_factory=OrderedDict)  # oldest news first


class KVIndex:
    def __init__(self, max_blocks_per_worker: int = 65536) -> None:
        self.max_blocks_per_worker = max_blocks_per_worker
        self.workers: dict[str, WorkerBlocks] = {}

    def apply(self, events: wire.KvEvents) -> None:
        """One record of a worker's events: cleared first, then evictions, then stores."""
        blocks = self.workers.get(events.worker_id)
        if blocks is None or events.cleared or blocks.block_size != events.block_size:
            blocks = self.workers[events.worker_id] = WorkerBlocks(events.block_size)
        keys = blocks.keys
        for key in events.evicted:
            keys.pop(key, None)
        for key in events.stored:
            keys[key] = None
            keys.move_to_end(key)
        while len(keys) > self.max_blocks_per_worker:
            keys.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def block_sizes(self) -> set[int]:
        return {blocks.block_size for blocks in self.workers.values()}

    def block_size(self, worker_id: str) -> int | None:
        blocks = self.workers.get(worker_id)
        return blocks.block_size if blocks is not None else None

    def num_blocks(self, worker_id: str) -> int:
        blocks = self.workers.get(worker_id)
        return len(blocks.keys) if blocks is not None else 0

    def matched_blocks(self, worker_id: str, prompt_keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its chained block keys, in order) the worker holds."""
        blocks = self.workers.get(worker_id)
        if blocks is None:
            return 0
        held = 0
        for key in prompt_keys:
            if key not in blocks.keys:
                break
            held += 1
        return held
