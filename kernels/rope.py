"""Rotary position embedding of each head by its token's angles (rotate-half layout, as Hugging
Face's Llama), in one pass: a PyTorch reference, a Triton kernel and a dispatcher. Left to
PyTorch it is nine elementwise kernels for each of q and k in every layer."""

import torch
import triton
import triton.language as tl

from kernels import cpu_elementwise
from kernels.checks import FLOAT_DTYPES, check_last_dim_contiguous, check_triton_device


def _check_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 3 or x.shape[2] % 2 != 0:
        raise ValueError(f"x must be (T, H, D) with D even; got {tuple(x.shape)}")
    half = (x.shape[0], 1, x.shape[2] // 2)
    if cos.shape != half or sin.shape != half:
        raise ValueError(f"cos and sin must be {half}; got {tuple(cos.shape)} and {tuple(sin.shape)}")


def apply_rope_ref(
    x: torch.Tensor,  # (T, H, D)
    cos: torch.Tensor,  # (T, 1, D/2) float32
    sin: torch.Tensor,  # (T, 1, D/2) float32
) -> torch.Tensor:  # (T, H, D) in x's dtype
    """The math in float32, rounded once at the end."""
    _check_inputs(x, cos, sin)
    x1, x2 = x.float().chunk(2, dim=-1)  # (T, H, D/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xt, stride_xh, stride_ct, stride_st, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program per token, all of its heads at once: the token's angles are loaded once.
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    mask = (h[:, None] < NUM_HEADS) & d_mask[None, :]
    cos = tl.load(cos_ptr + t * stride_ct + d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + t * stride_st + d, mask=d_mask, other=0.0)[None, :]
    src = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton version of apply_rope_ref; x may be a strided view (q or k of a fused projection)."""
    _check_inputs(x, cos, sin)
    check_triton_device(x, cos, sin)
    check_last_dim_contiguous(x=x, cos=cos, sin=sin)
    if x.dtype not in FLOAT_DTYPES or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"x must be one of {FLOAT_DTYPES} and cos, sin float32; got {x.dtype}, {cos.dtype}")
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    _rope_kernel[(num_tokens,)](
        x, cos, sin, out,
        x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads,
        HALF=head_dim // 2,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of x by its token's angles: the Triton kernel on a GPU, the C++ one in an
    eager float32 CPU step (cpu_elementwise.py), the reference elsewhere."""
    if x.is_cuda:
        return apply_rope_triton(x, cos, sin)
    _check_inputs(x, cos, sin)
    if cpu_elementwise.serves(x, cos, sin) and x.stride(1) == x.shape[2]:  # each token's heads one run
        return torch.ops.drivetrain.cpu_rope(x, cos, sin)
    return apply_rope_ref(x, cos, sin)
