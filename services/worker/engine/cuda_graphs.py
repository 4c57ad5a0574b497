"""Decode steps captured as CUDA graphs, one per batch size, replayed over static input buffers:
a decode step launches hundreds of small kernels, and a replay launches them all at once."""

from __future__ import annotations

import torch

from services.worker.engine.attention import AttentionMetadata
from services.worker.engine.block_pool import NULL_BLOCK_ID
from services.worker.engine.model import KVCache, LlamaModel

SMALL_BATCH_SIZES = (1, 2, 4, 8)
BATCH_SIZE_STEP = 16  # past 8, a size every 16: padding wastes at most 15 rows


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured sizes, ascending; the last one covers max_num_seqs."""
    sizes = [s for s in SMALL_BATCH_SIZES if s < max_num_seqs]
    sizes += range(BATCH_SIZE_STEP, max_num_seqs, BATCH_SIZE_STEP)
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


class CudaGraphRunner:
    """Owns the static buffers every graph reads; a batch of n sequences replays the smallest
    captured graph of size >= n, its extra rows padding that write nothing (slot -1) and read
    one token of the null block."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[KVCache],
        max_num_seqs: int,
        max_blocks_per_seq: int,
    ) -> None:
        device = kv_caches[0][0].device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need the KV cache on a CUDA device, got {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        size = self.batch_sizes[-1]
        # The graphs read these addresses forever: they are written in place, never replaced.
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)  # (B,)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)  # (B,)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)  # (B,)
        self.block_tables = torch.full(
            (size, max_blocks_per_seq), NULL_BLOCK_ID, dtype=torch.int32, device=device
        )  # (B, M)
        self.context_lens = torch.ones(size, dtype=torch.int32, device=device)  # (B,)
        self.cu_seqlens_q = torch.arange(size + 1, dtype=torch.int32, device=device)  # (B+1,): one token each
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # batch size -> (B, C) hidden states the graph writes

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of num_seqs replays, or None if it is too large."""
        return next((size for size in self.batch_sizes if size >= num_seqs), None)

    @torch.no_grad()
    def capture(self) -> None:
        # Largest first: the smaller graphs then fit inside the memory pool it reserved.
        pool = None
        for size in reversed(self.batch_sizes):
            args = self._model_args(size)
            # A plain run first compiles the Triton kernels (compiling inside a capture fails)
            # and settles the allocator. Every slot is -1, so neither run writes the KV cache.
            self.model(*args)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(*args)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def replay(
        self,
        input_ids: torch.Tensor,  # (B,) already padded to a captured size
        positions: torch.Tensor,  # (B,)
        slot_mapping: torch.Tensor,  # (B,) padding rows -1
        block_tables: torch.Tensor,  # (B, W), W <= M; padding rows the null block
        context_lens: torch.Tensor,  # (B,) padding rows 1
    ) -> torch.Tensor:  # (B, C)
        size = input_ids.shape[0]
        if size not in self.graphs:
            raise ValueError(f"no graph captured for batch size {size}; captured {self.batch_sizes}")
        width = block_tables.shape[1]
        self.input_ids[:size].copy_(input_ids, non_blocking=True)
        self.positions[:size].copy_(positions, non_blocking=True)
        self.slot_mapping[:size].copy_(slot_mapping, non_blocking=True)
        # Columns past `width` keep older steps' ids: the kernel reads only the first
        # ceil(context_len / block_size) entries of a row, all of which lie before `width`.
        self.block_tables[:size, :width].copy_(block_tables, non_blocking=True)
        self.context_lens[:size].copy_(context_lens, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size]

    def _model_args(self, size: int) -> tuple:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            context_lens=self.context_lens[:size],
            max_query_len=1,
        )
        return self.input_ids[:size], self.positions[:size], meta, self.kv_caches
