"""The C++ prompt attention kernel for the CPU (cpu_prefill_attention.cpp), built at the engine's start.

PyTorch's CPU flash attention runs each query head alone over key blocks of up to 512, and a causal
block on the diagonal is computed whole, masked half included: at a chunk of 512 query rows, the chunk's
own keys cost twice their work, and a cached prefix is a second call merged by log-sum-exps. The kernel
takes a chunk's causal attention over its prefix and itself in one call, the query heads that share a KV
head together, and stops each run of rows at the last key it sees. It is float32 only; cpu_attention.py
sends eager float32 prompt steps here once it is built for the CPU's vector instructions (cpu_extension.py;
a build without them refuses to run, where the fused kernel's BLAS products are faster), and keeps the fused
kernel elsewhere.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from kernels import cpu_extension

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")


@functools.cache
def available() -> bool:
    """Whether the kernel is built, registered and runs here (building it now if needed, once per
    process)."""
    if not cpu_extension.build(SOURCE, "the CPU prompt attention kernel", "prompts use PyTorch's fused attention"):
        return False
    torch.library.register_fake("drivetrain::cpu_prefill_attention")(_shape_of_output)
    try:  # a build without vector instructions refuses to run
        one = torch.ones(1, 1, 1, 1)
        torch.ops.drivetrain.cpu_prefill_attention(one, one, one, 1.0)
    except RuntimeError as exc:
        log.warning("the CPU prompt attention kernel cannot run (%s); prompts use PyTorch's fused attention", exc)
        return False
    return True


def serves(*tensors: torch.Tensor) -> bool:
    """Whether attention over these tensors runs here: all float32 on the CPU, in an eager step."""
    return (
        all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
        and not torch.compiler.is_compiling()
        and available()
    )


def _shape_of_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def prefill_attention(
    q: torch.Tensor,  # (n, L, Hq, D) float32: the last L positions of each sequence's context
    k: torch.Tensor,  # (n, C, Hkv, D) float32: each sequence's context, C >= L
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # (n, L, Hq, D)
    """Each query position's attention over its sequence's keys up to its own position (position i of L
    sits at C - L + i), once `available()`; query head j reads KV head j // (Hq / Hkv)."""
    q, k, v = (_heads_in_a_row(t) for t in (q, k, v))
    return torch.ops.drivetrain.cpu_prefill_attention(q, k, v, scale)


def _heads_in_a_row(x: torch.Tensor) -> torch.Tensor:
    """x with each position's heads one contiguous run, as the kernel reads them (a view where it is one)."""
    return x if x.stride(3) == 1 and x.stride(2) == x.shape[3] else x.contiguous()
