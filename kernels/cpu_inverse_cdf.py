"""The C++ inverse-transform sampler for the CPU (cpu_inverse_cdf.cpp), built at the engine's start.

Sampling a row by one uniform number needs the row's running sum of softmax weights up to the draw.
PyTorch writes the whole (N, V) softmax, then its float64 cumulative sum: 64 rows of SmolLM2's 49,152
logits took 4 ms for the softmax and its temperature and 8-15 ms for the sum (2-core Zen 4). The
kernel reads the logits twice, takes each weight's exp as it goes, sums blocks in float32 vectors and
the blocks in float64, and writes nothing but the token. services/worker/engine/sampler.py decides
where it runs.
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
    return cpu_extension.build(SOURCE, "the CPU inverse-CDF sampler", "sampled rows take PyTorch's cumsum")


def inverse_cdf(
    logits: torch.Tensor,  # (N, V) float32
    inv_temperature: torch.Tensor,  # (N,) float32
    drawn: torch.Tensor,  # (N,) float64 in [0, 1)
) -> torch.Tensor:  # (N,) int64
    """Each row's token whose share of the row's running softmax(logits * inv_temperature) holds its draw."""
    return torch.ops.drivetrain.inverse_cdf(logits, inv_temperature, drawn)
