"""Every request's block table as a row of one array: a step's tables are then one gather by row,
where flattening each request's list of block ids cost a pass over every block of every running
request, every step (tens of thousands of ids at long contexts). A row changes only when its
request gains blocks."""

from __future__ import annotations

import numpy as np

from services.worker.engine.block_pool import NULL_BLOCK_ID


class BlockTables:
    def __init__(self, max_blocks_per_request: int, num_rows: int = 64) -> None:
        self.array = np.full((num_rows, max_blocks_per_request), NULL_BLOCK_ID, dtype=np.int32)  # (R, W)
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._lengths: dict[int, int] = {}  # row -> blocks it holds

    def add_row(self) -> int:
        """A row of null blocks for a request that holds none yet."""
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self._lengths[row] = 0
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        start = self._lengths[row]
        self.array[row, start : start + len(block_ids)] = block_ids
        self._lengths[row] = start + len(block_ids)

    def release(self, row: int) -> None:
        self.array[row, : self._lengths.pop(row)] = NULL_BLOCK_ID
        self._free_rows.append(row)

    def block_ids(self, row: int) -> list[int]:
        return self.array[row, : self._lengths[row]].tolist()

    def _grow(self) -> None:
        # Parked and arriving handoffs hold rows besides the running batch: no fixed bound.
        old = self.array
        self.array = np.full((2 * len(old), old.shape[1]), NULL_BLOCK_ID, dtype=np.int32)
        self.array[: len(old)] = old
        self._free_rows.extend(range(len(self.array) - 1, len(old) - 1, -1))
