"""Weight-only quantization of a loaded model, for decoding on a CPU.

Decoding a few streams reads every weight once per token, so its speed is the bytes read: int8
weights are a quarter of float32's, int4 an eighth. The matrices are multiplied by PyTorch's own
packed-weight kernels, with bfloat16 activations (their fast path):
- int8: one scale per output channel (`_weight_int8pack_mm`);
- int4: groups of 32 input channels, each with a scale and an offset (`_weight_int4pack_mm_for_cpu`):
  llama.cpp's Q4_1 layout, so SmolLM2's shipped Q4_1 weights come back exactly, up to bfloat16
  rounding of the scales. The output layer stays int8, as the shipped file keeps it in Q8_0.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.engine.model import LlamaModel

INT8_MAX = 127
INT4_LEVELS = 15  # codes 0..15
INT4_GROUP = 32  # input channels sharing one scale and offset, as in Q4_1
INT4_MIDPOINT = 8  # the kernel reads a code q as (q - 8) * scale + offset
INT4_INNER_K_TILES = 1  # a GPU packing's tiling: the CPU packing takes the argument and ignores it


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


def int4_codes(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 of (out, in) weights by groups of `group` inputs: codes (out, in) int32 in
    0..15, and per group a scale and the value of code 0, both (out, in / group) float32."""
    out_features, in_features = weight.shape
    w = weight.detach().float().view(out_features, in_features // group, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)  # (out, G)
    scale = ((high - low) / INT4_LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, INT4_LEVELS)
    return codes.view(out_features, in_features).to(torch.int32), scale, low


class Int4Linear(nn.Module):
    """y = x W^T with W stored as packed int4 codes and, per group of inputs, a scale and an offset."""

    def __init__(self, weight: torch.Tensor, group: int = INT4_GROUP) -> None:  # (out, in), any float dtype
        super().__init__()
        out_features, in_features = weight.shape
        if in_features % group:
            raise ValueError(f"int4 needs input features divisible by {group}, got {in_features}")
        codes, scale, low = int4_codes(weight, group)
        self.group = group
        self.out_features = out_features
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INT4_INNER_K_TILES))
        # (in / group, out, 2): the kernel's layout of [scale, value of the midpoint code].
        offset = low + INT4_MIDPOINT * scale
        self.register_buffer("scales_and_zeros", torch.stack([scale, offset], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out), x's dtype
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, self.group, self.scales_and_zeros)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


PROJECTIONS: dict[str, type[nn.Module]] = {"int8": Int8Linear, "int4": Int4Linear}


def quantize_(model: LlamaModel, scheme: str) -> LlamaModel:
    """Swap every projection for the scheme's (int8 or int4), and the output layer for Int8Linear,
    in place. The embedding table stays as it is (a lookup reads one row); tied weights get an int8
    copy for the logits."""
    if scheme not in PROJECTIONS:
        raise ValueError(f"weight-only quantization is one of {sorted(PROJECTIONS)}, got {scheme!r}")
    quantized = PROJECTIONS[scheme]
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        attention.qkv_proj = quantized(attention.qkv_proj.weight)
        attention.o_proj = quantized(attention.o_proj.weight)
        mlp.gate_up_proj = quantized(mlp.gate_up_proj.weight)
        mlp.down_proj = quantized(mlp.down_proj.weight)
    output = model.embed_tokens if model.lm_head is None else model.lm_head
    model.lm_head = Int8Linear(output.weight)
    return model
