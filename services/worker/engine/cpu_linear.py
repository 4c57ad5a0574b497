"""Float32 projections on a CPU through oneDNN, each weight packed once into oneDNN's own layout.

PyTorch's linear hands float32 to MKL's GEMM, which on the AMD machines measured reads the weights
well below memory bandwidth at a decode step's few rows and computes a prompt chunk's many at half
the cores' peak. oneDNN's matmul over a weight reordered once for it (`mkldnn._linear_pointwise`,
the op inductor itself emits for frozen float32 linears) was faster at every SmolLM2 shape but one
(2-core AVX-512 EPYC, loadtest/bench_cpu_linear.py): the output layer 2.1x at one row and 1.7x at
64, the MLP's gate/up 2.4x at one row, 1.3x at 64 and 1.4x at 512.

A graph exported from the model (cpu_graphs.py) is traced with these packed weights, which
inductor's freezing keeps for its oneDNN products or repacks for GEMM kernels of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.engine.model import LlamaModel
from services.worker.engine.shared_weights import tensor_digest

PACKED_FOR_ROWS = 64  # oneDNN's layout hint; any row count runs, and 16 to 512 measured alike


def pack(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) float32 -> an opaque oneDNN tensor for `project`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACKED_FOR_ROWS)


def project(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) for x (..., in) and W packed by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class CpuLinear(nn.Module):
    """A linear layer whose product goes through the packed weight, the only copy it keeps. The digest
    of the dense weight it was packed from stands for it in the keys of the stored graphs
    (cpu_graphs.weights_digest)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.packed = pack(weight)
        self.dense_digest = tensor_digest(weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.packed, self.bias)


def use_cpu_linear_(model: LlamaModel) -> LlamaModel:
    """Swap every float32 projection, and the output layer, for CpuLinear, in place: the dense weights
    go (but the embedding's, where the output layer shares it)."""
    for layer in model.layers:
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):  # fmt: skip
            linear = getattr(owner, name)
            bias = None if linear.bias is None else linear.bias.data
            setattr(owner, name, CpuLinear(linear.weight.data, bias))
    output = model.embed_tokens if model.lm_head is None else model.lm_head
    model.lm_head = CpuLinear(output.weight.data)
    return model
