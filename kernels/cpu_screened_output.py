"""The C++ screened output kernel for the CPU (cpu_screened_output.cpp), built at the engine's start.

A row decoded greedily needs the largest of its logits, and a row sampled at a temperature a draw from
their softmax, not every logit in float32: a bfloat16 product of the output layer (half the bytes, and
twice the arithmetic rate where the cores multiply bfloat16) bounds each token's float32 logit within a
margin, and the kernel rescores in float32 only the tokens the bounds cannot settle: a greedy row's
contenders for its argmax, a sampled row's likeliest tokens and the proposals it keeps or refuses.
services/worker/engine/screened_output.py owns the screen's weights and decides where it runs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels import cpu_extension

SOURCE = Path(__file__).with_suffix(".cpp")
BFLOAT16_ROUNDOFF = 2.0**-9  # half a unit in the last of bfloat16's 8 significant bits
FLOAT32_ROUNDOFF = 2.0**-24
FELL_BACK = -1  # a sampled row the screen did not draw: its caller draws it from every float32 logit
# A sampled row rescores the tokens whose upper bound reaches within RESCORED_WINDOW * T of its greedy floor,
# up to MOST_RESCORED (~0.1 ms) of them. Over 333 states of SmolLM2's answers sampled at 0.7 (scratch),
# the window to the largest upper bound less 4 T rescored 3 tokens a row at the median (12 at p90, 51 at
# most), where the bounds alone would keep 43 % of proposals; from the floor, as here, a row refused a
# proposal with probability 0.015 on average (0.05 at p90, 0.15 at worst) at T = 0.7, 0.034 at T = 1,
# 0.08 at T = 1.5 and 0.001 at T = 0.3 (20 proposals a state).
RESCORED_WINDOW = 4.0
MOST_RESCORED = 1024


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (building it now if needed, once per process)."""
    if not cpu_extension.build(SOURCE, "the CPU screened output kernel", "every row takes every float32 logit"):
        return False
    torch.library.register_fake("drivetrain::screened_tokens")(_shape_of_output)
    return True


def slack(width: int) -> float:
    """The bound's factor on |h| |w_v| for rows of `width` products: both inputs rounded to bfloat16
    (2u + u^2 of each product), and float32 sums of `width` terms, the screen's and the rescoring's on
    either side of a comparison (a few times gamma_width), with a margin for the norms' own rounding."""
    u = BFLOAT16_ROUNDOFF
    gamma = width * FLOAT32_ROUNDOFF / (1 - width * FLOAT32_ROUNDOFF)
    return (2 * u + u * u + 4 * gamma) * (1 + 2.0**-10)


def screened_tokens(
    screen: torch.Tensor,  # (S, V) bfloat16: hidden @ weight^T, both rounded to bfloat16
    hidden: torch.Tensor,  # (S, C) float32
    weight: torch.Tensor,  # (V, C) float32
    norms: torch.Tensor,  # (V,) float32: each row of weight's Euclidean norm
    temperature: torch.Tensor,  # (S,) float32: 0 for a greedy row
    drawn: torch.Tensor,  # (S, 2 * attempts) float64 in [0, 1): a sampled row's numbers, two an attempt
) -> torch.Tensor:  # (S,) int64
    """A greedy row's argmax of hidden @ weight^T in float32 (the first of equals; NaN counts as largest);
    a sampled row's draw from softmax(hidden @ weight^T / temperature), or FELL_BACK where it refused
    every proposal or is not finite."""
    return torch.ops.drivetrain.screened_tokens(screen, hidden, weight, norms, slack(weight.shape[1]),
                                                temperature, drawn, RESCORED_WINDOW, MOST_RESCORED)


def _shape_of_output(screen, hidden, weight, norms, slack, temperature, drawn, window, most_rescored):
    return screen.new_empty(screen.shape[0], dtype=torch.int64)
