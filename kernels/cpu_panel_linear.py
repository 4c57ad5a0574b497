"""The C++ projection over weights laid out in panels of columns (cpu_panel_linear.cpp), float32, and
bfloat16 where the CPU has AVX-512's bfloat16 dot products; built on first use.

oneDNN's packed float32 products (services/worker/engine/cpu_linear.py) wait on the weights between
blocks of their work at a decode step's rows; this kernel asks for each panel's weights while it
multiplies the one before. SmolLM2's four products a layer, 30 layers' weights in turn, 2 threads on
a 2-core Zen 4 (loadtest/bench_cpu_panel_linear.py): 0.70-0.98 of oneDNN's time from one row to 512,
0.82 at 64; both limited to AVX2 there, 0.52-0.97. In bfloat16, against oneDNN's bfloat16 products:
0.70 at one row, 0.59 at 16, 0.86 at 64. It serves CPUs with AVX2 or AVX-512; elsewhere, and where it cannot be
built, projections stay oneDNN's.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels import cpu_extension

SOURCE = Path(__file__).with_suffix(".cpp")
BUILT_FOR = ("AVX2", "AVX512")  # torch.backends.cpu's names of the ISAs the kernel has registers for


@functools.cache
def _built() -> bool:
    if torch.backends.cpu.get_cpu_capability() not in BUILT_FOR:
        return False
    if not cpu_extension.build(SOURCE, "the CPU panel projection", "projections stay oneDNN's"):
        return False
    torch.library.register_fake("drivetrain::panel_linear")(_shape_of_output)
    return True


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernel is built and multiplies `dtype` on this CPU (building it now, once per process)."""
    if dtype == torch.float32:
        return _built()
    return dtype == torch.bfloat16 and _built() and torch.ops.drivetrain.panels_take_bfloat16()


def _shape_of_output(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) float32 -> (ceil(N / width), K, width): each panel a width of W's rows, input by input;
    bfloat16 -> (ceil(N / width), ceil(K / 2), 2 width): inputs in pairs, each column's two side by side."""
    return torch.ops.drivetrain.pack_panels(weight.detach().contiguous())


def unpack(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The dense (N, K) weight `pack` laid out, as tensor operations (a graph's constant folding runs them)."""
    count, steps, columns = panels.shape
    pairs = 2 if panels.dtype == torch.bfloat16 else 1
    by_column = panels.view(count, steps, columns // pairs, pairs).permute(0, 2, 1, 3)
    return by_column.reshape(-1, steps * pairs)[:n, :k]


def project(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) for x (..., K) and W (N, K) packed by `pack`, in the panels' dtype."""
    return torch.ops.drivetrain.panel_linear(x, panels, n, bias)
