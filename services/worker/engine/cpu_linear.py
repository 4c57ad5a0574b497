"""Float32 projections on a CPU at the batch sizes of decoding.

MKL's float32 GEMM, called the way PyTorch's linear calls it (x W^T), is slow for a handful of
rows: on the AVX2 machine these figures come from, a decode step's projections over a SmolLM2
shape took 1.7x (64 rows) to 3.3x (4 rows) longer than the same product computed as W x^T. So a
step of 2 to MAX_ROWS rows goes through W x^T (the weight as it is, no copy); one row (a
matrix-vector product) and a prompt chunk's many rows stay with linear, which is as fast there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.model import LlamaModel

MAX_ROWS = 128  # above this the two orders cost about the same, and the transpose back is extra


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) for x (..., in) and W (out, in), in the faster order for x's row count."""
    rows = x.reshape(-1, x.shape[-1])
    # A compiled graph leaves the choice to inductor, which matches linear, not this order.
    if torch.compiler.is_compiling() or not 2 <= rows.shape[0] <= MAX_ROWS:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, rows.t()).t().contiguous()  # (N, out)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class CpuLinear(nn.Module):
    """A linear layer whose product goes through `project`; it holds the same weight tensor."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias)


def use_cpu_linear_(model: LlamaModel) -> LlamaModel:
    """Swap every projection, and the output layer, for CpuLinear, in place (no weight copied)."""
    for layer in model.layers:
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):  # fmt: skip
            linear = getattr(owner, name)
            setattr(owner, name, CpuLinear(linear.weight.data, None if linear.bias is None else linear.bias.data))
    output = model.embed_tokens if model.lm_head is None else model.lm_head
    model.lm_head = CpuLinear(output.weight.data)  # tied: the embedding's own tensor, shared
    return model
