"""The C++ grammar-mask kernel for the CPU (cpu_token_bitmask.cpp), built at the engine's start.

Applying 64 rows' masks to SmolLM2's 49,152 logits through tensor operations (a table lookup per mask
byte into a penalty of 64 x 49,152 floats in fresh memory, then an add into the rows) took 1.75-9.1 ms
on a 2-core Zen 4; the kernel writes -inf over the refused logits in place, 0.43 ms
(loadtest/bench_grammar_mask.py). services/worker/engine/grammar_mask.py decides where it runs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels import cpu_extension

SOURCE = Path(__file__).with_suffix(".cpp")


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (building it now if needed, once per process)."""
    return cpu_extension.build(SOURCE, "the CPU grammar-mask kernel", "masks are applied by tensor operations")


def serves(logits: torch.Tensor) -> bool:
    """Whether masks on these logits are applied here: contiguous float32 on the CPU."""
    return logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.is_contiguous() and available()


def apply_token_bitmask(
    logits: torch.Tensor,  # (S, V) float32, contiguous, changed in place
    rows: torch.Tensor,  # (R,) int64
    bitmask: torch.Tensor,  # (R, W) int32
) -> None:
    torch.ops.drivetrain.apply_token_bitmask(logits, rows, bitmask)
