"""Quantization of a loaded model's projections, for serving on a CPU.

Decoding a few streams reads every weight once per token, so its speed is the bytes read: int8
weights are a quarter of float32's, int4 an eighth. Weight-only schemes multiply by PyTorch's own
packed-weight kernels, with bfloat16 activations (their fast path):
- int8: one scale per output channel (`_weight_int8pack_mm`; a prompt chunk's many rows, bound by
  arithmetic, multiply by the weights widened to float32 instead: see WIDENED_FROM_ROWS);
- int4: groups of 32 input channels, each with a scale and an offset (`_weight_int4pack_mm_for_cpu`):
  llama.cpp's Q4_1 layout, so SmolLM2's shipped Q4_1 weights come back exactly, up to bfloat16
  rounding of the scales. The output layer stays int8, as the shipped file keeps it in Q8_0.

Many streams at once, and long prompts, are bound by arithmetic instead: a product of 64 rows
costs the same float multiplies whatever the weights' width. `w8a8` quantizes the activations
too, per row at every call (8 bits with VNNI, 7 without), and multiplies in integers through
oneDNN (`onednn.qlinear_pointwise`, the kernel inductor's own int8 lowering calls); with
AVX512-VNNI a 64-row SmolLM2 product ran 3.5-8x faster than float32's. All of its layers, the
output one included, are W8A8.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.engine.model import LlamaModel

INT8_MAX = 127
# A prompt's rows are bound by arithmetic, where ATen's int8 kernel multiplies at half float32's rate:
# SmolLM2's projections on a 2-core Zen 3 EPYC (AVX2) at 82-89 GFLOPS from 64 rows to 2,048, where
# widening the weights to float32 once per call and multiplying them as float32 ran 105-114 GFLOPS
# at 96 rows, 123-128 at 128 and 167-184 from 512 (64 rows: 46-85, no gain). So an eager call of at
# least this many rows (a prompt chunk) multiplies float32 rows by widened weights; a compiled graph
# keeps its lowered int8 kernels (decode steps, whose rows read the weights more than they multiply).
WIDENED_FROM_ROWS = 128
INT4_LEVELS = 15  # codes 0..15
INT4_GROUP = 32  # input channels sharing one scale and offset, as in Q4_1
INT4_MIDPOINT = 8  # the kernel reads a code q as (q - 8) * scale + offset
INT4_INNER_K_TILES = 1  # a GPU packing's tiling: the CPU packing takes the argument and ignores it
# Without VNNI, x86 multiplies unsigned by signed bytes with vpmaddubsw, which sums each pair of
# products in 16 bits and saturates: an activation code of 255 times a weight of 127, twice,
# overflows; 127 times 127, twice, does not. So activations there get 7 bits.
INT7_MAX = 63


def row_scales(rows: torch.Tensor, levels: int) -> torch.Tensor:
    """(N, 1): each row's largest magnitude over `levels` (never zero), so its codes fill -levels..levels."""
    return rows.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / levels


def int8_rows(weight: torch.Tensor, levels: int = INT8_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric codes -levels..levels of (out, in) values as int8, one float32 scale per row."""
    w = weight.detach().float()
    scale = row_scales(w, levels)  # (out, 1)
    return torch.round(w / scale).clamp(-levels, levels).to(torch.int8), scale.squeeze(1)


def activation_levels() -> int:
    """The widest activation codes this CPU's int8 products take exactly (see INT7_MAX)."""
    return INT8_MAX if torch.cpu._is_vnni_supported() else INT7_MAX


class Int8Linear(nn.Module):
    """y = x W^T with W stored as int8 rows times a per-row scale."""

    def __init__(self, weight: torch.Tensor) -> None:  # (out, in), any float dtype
        super().__init__()
        codes, scale = int8_rows(weight)
        self.register_buffer("weight", codes)
        self.register_buffer("scale", scale.to(torch.bfloat16))

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out), x's dtype
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] >= WIDENED_FROM_ROWS and not torch.compiler.is_compiling():
            weight = self.weight.to(torch.float32) * self.scale.to(torch.float32)[:, None]  # (out, in)
            out = torch.mm(rows.to(torch.float32), weight.t())
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), self.weight, self.scale)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


class W8A8Linear(nn.Module):
    """y = x W^T with W as int8 rows times a per-row scale, and x quantized per row at each call:
    the product runs in integers (oneDNN), then takes both scales. oneDNN's fast path takes
    unsigned activations with one zero point, so a row's symmetric codes are shifted by
    levels + 1 and its own scale is applied to the output row."""

    def __init__(self, weight: torch.Tensor, levels: int | None = None) -> None:  # weight: (out, in), any float
        super().__init__()
        codes, scale = int8_rows(weight)
        self.out_features = codes.shape[0]
        self.levels = activation_levels() if levels is None else levels
        self.register_buffer("weight", torch.ops.onednn.qlinear_prepack(codes, None))  # oneDNN's own layout
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_zero_point", torch.zeros(self.out_features, dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out), x's dtype
        rows = x.reshape(-1, x.shape[-1]).float()
        row_scale = row_scales(rows, self.levels)
        zero_point = self.levels + 1
        codes = (torch.round(rows / row_scale) + zero_point).to(torch.uint8)
        out = torch.ops.onednn.qlinear_pointwise(  # the input scale is 1: the rows' come after
            codes, 1.0, zero_point, self.weight, self.weight_scale, self.weight_zero_point,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # (N, out) float32: the codes' products times W's scales
        return (out * row_scale).to(x.dtype).view(*x.shape[:-1], self.out_features)


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


PROJECTIONS: dict[str, type[nn.Module]] = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear}
OUTPUT_LAYERS: dict[str, type[nn.Module]] = {"int8": Int8Linear, "int4": Int8Linear, "w8a8": W8A8Linear}


def scheme_of(model: LlamaModel) -> str | None:
    """The scheme quantize_ applied to the model's projections (int8, int4 or w8a8), or None."""
    projection = model.layers[0].self_attn.qkv_proj
    return next((scheme for scheme, kind in PROJECTIONS.items() if isinstance(projection, kind)), None)


def quantize_(model: LlamaModel, scheme: str) -> LlamaModel:
    """Swap every projection for the scheme's (int8, int4 or w8a8), and the output layer for its
    int8 one, in place. The embedding table stays as it is (a lookup reads one row); tied weights
    get an int8 copy for the logits."""
    if scheme not in PROJECTIONS:
        raise ValueError(f"quantization is one of {sorted(PROJECTIONS)}, got {scheme!r}")
    quantized = PROJECTIONS[scheme]
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        attention.qkv_proj = quantized(attention.qkv_proj.weight)
        attention.o_proj = quantized(attention.o_proj.weight)
        mlp.gate_up_proj = quantized(mlp.gate_up_proj.weight)
        mlp.down_proj = quantized(mlp.down_proj.weight)
    output = model.embed_tokens if model.lm_head is None else model.lm_head
    model.lm_head = OUTPUT_LAYERS[scheme](output.weight)
    return model
