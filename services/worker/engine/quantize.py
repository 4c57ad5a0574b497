"""Weight-only int8 quantization of a loaded model, for decoding on a CPU.

Decoding a few streams reads every weight once per token, so its speed is the bytes read:
int8 weights are a quarter of float32's. Each output channel keeps one scale; the matrices are
multiplied by PyTorch's own int8-weight kernel, with bfloat16 activations (its fast path).
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.engine.model import LlamaModel

INT8_MAX = 127


class Int8Linear(nn.Module):
    """y = x W^T with W stored as int8 rows times a per-row scale."""

    def __init__(self, weight: torch.Tensor) -> None:  # (out, in), any float dtype
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX  # (out,)
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out), x's dtype
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scale)  # (N, out) bfloat16
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


def quantize_int8_(model: LlamaModel) -> LlamaModel:
    """Swap every projection and the output layer for Int8Linear, in place. The embedding table
    stays as it is (a lookup reads one row); tied weights get an int8 copy for the logits."""
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        attention.qkv_proj = Int8Linear(attention.qkv_proj.weight)
        attention.o_proj = Int8Linear(attention.o_proj.weight)
        mlp.gate_up_proj = Int8Linear(mlp.gate_up_proj.weight)
        mlp.down_proj = Int8Linear(mlp.down_proj.weight)
    output = model.embed_tokens if model.lm_head is None else model.lm_head
    model.lm_head = Int8Linear(output.weight)
    return model
