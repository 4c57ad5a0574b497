"""The C++ decode attention kernel for the CPU (cpu_paged_decode.cpp), built on first use.

A step of many decoding sequences is bound by reading their caches. The same attention as plain
tensor operations, compiled by inductor, loops over the positions once per 16 of a head's dimensions
and per query head, and reads the cache at about a quarter of a plain read's speed; the kernel reads
each slot's row once, asking for the rows ahead while it works on the current one. It is built on first
use (cpu_extension.py); where it cannot be, `available()` says so and callers use the tensor operations.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels import cpu_extension

SOURCE = Path(__file__).with_suffix(".cpp")
HEAD_DIMS = (16, 32, 64, 128, 256)  # the kernel's compiled-in head sizes
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (building it now if needed, once per process)."""
    if not cpu_extension.build(SOURCE, "the CPU decode attention kernel", "decode attention runs without it"):
        return False
    torch.library.register_fake("drivetrain::paged_decode_attention")(_shape_of_output)
    return True


def supports(head_dim: int, cache_dtype: torch.dtype) -> bool:
    """Whether the kernel serves a model of this head size and KV cache dtype (and can be built)."""
    return head_dim in HEAD_DIMS and cache_dtype in CACHE_DTYPES and available()


def _shape_of_output(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, read_slots: torch.Tensor,
                     lengths: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


def paged_decode_attention(
    q: torch.Tensor,  # (n, Hq, D) float32: one new token per sequence
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D) float32, bfloat16 or float16
    v_cache: torch.Tensor,
    read_slots: torch.Tensor,  # (n, S) int64: the flat slot of each position, in order
    lengths: torch.Tensor,  # (n,) int64: positions each sequence reads, 1..S
    scale: float,
) -> torch.Tensor:  # (n, Hq, D) float32
    """Each row's attention over the first `lengths[i]` slots of its `read_slots` row, once `available()`
    has loaded the kernel. The slots are trusted: they come from the engine's own block tables."""
    return torch.ops.drivetrain.paged_decode_attention(q, k_cache, v_cache, read_slots, lengths, scale)
