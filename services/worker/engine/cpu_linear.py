"""Projections on a CPU through packed weights: oneDNN's own layout, or the panel kernel's.

PyTorch's linear hands float32 to MKL's GEMM, which on the AMD machines measured reads the weights
well below memory bandwidth at a decode step's few rows and computes a prompt chunk's many at half
the cores' peak. oneDNN's matmul over a weight reordered once for it (`mkldnn._linear_pointwise`,
the op inductor itself emits for frozen float32 linears) was faster at every SmolLM2 shape but one
(2-core AVX-512 EPYC, loadtest/bench_cpu_linear.py): the output layer 2.1x at one row and 1.7x at
64, the MLP's gate/up 2.4x at one row, 1.3x at 64 and 1.4x at 512.

Where the panel kernel builds (kernels/cpu_panel_linear.py: AVX2 or AVX-512), a projection's weight is laid
out in its panels instead, which asks for the weights ahead of its arithmetic and beat oneDNN's at
every row count measured; oneDNN's packs serve elsewhere (`pack` and `project`). A bfloat16 weight,
a model's projections or the output screen's (screened_output.py), goes into panels where
the CPU multiplies bfloat16 pairs (AVX512_BF16): at one row oneDNN's bfloat16 products took 1.4x the
panels' time, and a bfloat16 stream decoded slower than a float32 one.

A graph exported from the model (cpu_graphs.py) is traced with the weights as held: the many-rows
graph multiplies with them. Traced for autotuning (`traced_dense`), a projection is a linear over its
dense weight, unpacked by operations that freezing folds, so that inductor times its own GEMM kernels
against oneDNN's and packs what it picks.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_panel_linear
from services.worker.engine.model import LlamaModel
from services.worker.engine.shared_weights import tensor_digest

PACKED_FOR_ROWS = 64  # oneDNN's layout hint; any row count runs, and 16 to 512 measured alike


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) float32 -> an opaque oneDNN tensor for `project`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACKED_FOR_ROWS)


def project(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) for x (..., in) and W packed by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_TRACED_DENSE = contextvars.ContextVar("traced_dense", default=False)


@contextlib.contextmanager
def traced_dense() -> Iterator[None]:
    """Within it, projections held in panels trace as linears over their dense weights."""
    token = _TRACED_DENSE.set(True)
    try:
        yield
    finally:
        _TRACED_DENSE.reset(token)


class CpuLinear(nn.Module):
    """A linear layer whose product goes through its packed weight, the only copy it keeps: in the panel
    kernel's layout where it builds (`in_panels`), else oneDNN's. The digest of the dense weight it was
    packed from stands for it in the keys of the stored graphs (cpu_graphs.weights_digest)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, panels: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.in_panels = panels and cpu_panel_linear.available(weight.dtype)
        self.packed = cpu_panel_linear.pack(weight) if self.in_panels else pack(weight)
        self.dense_digest = tensor_digest(weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.in_panels:
            return project(x, self.packed, self.bias)
        if _TRACED_DENSE.get():
            return F.linear(x, cpu_panel_linear.unpack(self.packed, self.out_features, self.in_features), self.bias)
        return cpu_panel_linear.project(x, self.packed, self.out_features, self.bias)


def use_cpu_linear_(model: LlamaModel, panels: bool = True) -> LlamaModel:
    """Swap every projection, and the output layer, for CpuLinear, in place: the dense weights go (but
    the embedding's, where the output layer shares it). panels: in the panel kernel's layout where it
    multiplies the weights' dtype; else oneDNN's."""
    for layer in model.layers:
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):  # fmt: skip
            linear = getattr(owner, name)
            bias = None if linear.bias is None else linear.bias.data
            setattr(owner, name, CpuLinear(linear.weight.data, bias, panels))
    output = model.embed_tokens if model.lm_head is None else model.lm_head
    model.lm_head = CpuLinear(output.weight.data, panels=panels)
    return model
