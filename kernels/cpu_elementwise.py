"""The C++ CPU kernels of the small float32 operations between a layer's products
(cpu_elementwise.cpp): SwiGLU's gate, the residual add with the RMSNorm after it, and rotary
embedding, each one pass over its rows where PyTorch takes three to nine. The dispatchers in
silu_mul.py, rms_norm.py and rope.py send eager float32 CPU steps here once the kernels are built
(cpu_extension.py); a graph being traced keeps the references, whose operations inductor fuses itself.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels import cpu_extension

SOURCE = Path(__file__).with_suffix(".cpp")


@functools.cache
def available() -> bool:
    """Whether the kernels are built and registered (building them now if needed, once per process)."""
    return cpu_extension.build(SOURCE, "the CPU elementwise kernels", "eager steps run PyTorch's own operations")


def serves(*tensors: torch.Tensor) -> bool:
    """Whether an operation on these tensors runs here: all float32 on the CPU with each row
    contiguous, in an eager step."""
    return (
        all(t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)
        and not torch.compiler.is_compiling()
        and available()
    )
