"""The C++ greedy output kernel for the CPU (cpu_greedy_output.cpp), built at the engine's start.

Rows that want only their likeliest token need the largest of their logits, not all of them in float32:
a bfloat16 product of the output layer (half the bytes, and twice the arithmetic rate where the cores
multiply bfloat16) bounds each token's float32 logit within a margin, and the kernel rescores in float32
only the tokens whose bounds reach the row's best. services/worker/engine/greedy_output.py owns the
screen's weights and decides where it runs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels import cpu_extension

SOURCE = Path(__file__).with_suffix(".cpp")
BFLOAT16_ROUNDOFF = 2.0**-9  # half a unit in the last of bfloat16's 8 significant bits
FLOAT32_ROUNDOFF = 2.0**-24


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (building it now if needed, once per process)."""
    if not cpu_extension.build(SOURCE, "the CPU greedy output kernel", "greedy rows take every float32 logit"):
        return False
    torch.library.register_fake("drivetrain::screened_argmax")(_shape_of_output)
    return True


def slack(width: int) -> float:
    """The bound's factor on |h| |w_v| for rows of `width` products: both inputs rounded to bfloat16
    (2u + u^2 of each product), and float32 sums of `width` terms, the screen's and the rescoring's on
    either side of a comparison (a few times gamma_width), with a margin for the norms' own rounding."""
    u = BFLOAT16_ROUNDOFF
    gamma = width * FLOAT32_ROUNDOFF / (1 - width * FLOAT32_ROUNDOFF)
    return (2 * u + u * u + 4 * gamma) * (1 + 2.0**-10)


def screened_argmax(
    screen: torch.Tensor,  # (S, V) bfloat16: hidden @ weight^T, both rounded to bfloat16
    hidden: torch.Tensor,  # (S, C) float32
    weight: torch.Tensor,  # (V, C) float32
    norms: torch.Tensor,  # (V,) float32: each row of weight's Euclidean norm
) -> torch.Tensor:  # (S,) int64
    """Each row's argmax of hidden @ weight^T in float32 (the first of equals; NaN counts as largest)."""
    return torch.ops.drivetrain.screened_argmax(screen, hidden, weight, norms, slack(weight.shape[1]))


def _shape_of_output(screen, hidden, weight, norms, slack):
    return screen.new_empty(screen.shape[0], dtype=torch.int64)
