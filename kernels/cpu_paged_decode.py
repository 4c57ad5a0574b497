"""The C++ decode attention kernel for the CPU (cpu_paged_decode.cpp), built on first use.

A step of many decoding sequences is bound by reading their caches. The same attention as plain
tensor operations, compiled by inductor, loops over the positions once per 16 of a head's dimensions
and per query head, and reads the cache at about a quarter of a plain read's speed; the kernel reads
each slot's row once, asking for the rows ahead while it works on the current one. It is compiled
with the C++ compiler torch.compile uses, for the instruction set PyTorch's own kernels picked on this
machine, and kept in PyTorch's extension cache (TORCH_EXTENSIONS_DIR): a later start loads it in well
under a second. Where it cannot be built, `available()` says so and callers use the tensor operations.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
HEAD_DIMS = (16, 32, 64, 128, 256)  # the kernel's compiled-in head sizes
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The flags inductor's own C++ kernels get for the same capability: at::vec then uses those registers.
# F16C converts a float16 cache's halves as they load (AVX-512F has the conversion of its own).
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (building it now if needed, once per process)."""
    capability = torch.backends.cpu.get_cpu_capability()
    capability = capability if capability in ISA_FLAGS else "DEFAULT"
    try:
        from torch.utils import cpp_extension

        find_ninja()
        cpp_extension.load(
            name=f"drivetrain_cpu_paged_decode_{capability.lower()}",
            sources=[str(SOURCE)],
            extra_cflags=compile_flags(capability),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: the tensor operations serve
        first_line = next(iter(str(exc).splitlines()), "")[:300]
        log.warning("the CPU decode attention kernel could not be built (%s: %s); decode attention runs "
                    "without it", type(exc).__name__, first_line)
        log.debug("building the CPU decode attention kernel", exc_info=True)
        return False
    torch.library.register_fake("drivetrain::paged_decode_attention")(_shape_of_output)
    return True


def compile_flags(capability: str) -> list[str]:
    """The compiler's flags for one of PyTorch's CPU capabilities (AVX512, AVX2, or DEFAULT: none)."""
    return ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}",
            *ISA_FLAGS.get(capability, [])]


def find_ninja() -> None:
    """cpp_extension runs `ninja` from PATH; a process started without its virtualenv's bin on PATH
    finds the one the `ninja` package installed there all the same."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


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
