"""The residual add and the RMSNorm after it, in one pass over each row: a PyTorch reference, a
Triton kernel and a dispatcher. Left to PyTorch, the pair is nine elementwise kernels; on a GPU
decoding one token each of them costs a launch's latency for next to no work."""

import torch
import triton
import triton.language as tl

from kernels import cpu_elementwise
from kernels.checks import FLOAT_DTYPES, check_triton_device


def _check_inputs(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be (T, C); got {tuple(x.shape)}")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"delta must match x {tuple(x.shape)} {x.dtype}; got {tuple(delta.shape)} {delta.dtype}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be ({x.shape[1]},); got {tuple(weight.shape)}")


def add_rms_norm_ref(
    x: torch.Tensor,  # (T, C)
    delta: torch.Tensor | None,  # (T, C), or None: nothing to add
    weight: torch.Tensor,  # (C,)
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (x + delta, its norm times weight), each (T, C)
    """The sum rounded to x's dtype (it is the residual stream the next add reads), then normed
    with the mean of squares in float32: bf16 would lose the small channels."""
    _check_inputs(x, delta, weight)
    if delta is not None:
        x = x + delta
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x, weight * normed.to(x.dtype)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr,
    stride_x, stride_delta, stride_sum, stride_out,
    eps,
    NUM_COLS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_DELTA: tl.constexpr,
):
    # One program per row, the whole row in registers: the mean needs every column first.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < NUM_COLS
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / NUM_COLS
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_triton(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of add_rms_norm_ref, for a weight in x's dtype."""
    _check_inputs(x, delta, weight)
    tensors = (x, weight) if delta is None else (x, delta, weight)
    check_triton_device(*tensors)
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one of {FLOAT_DTYPES}; got {x.dtype} and {weight.dtype}")
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("x, delta and weight must be contiguous in their last dim")
    num_rows, num_cols = x.shape
    summed = x if delta is None else torch.empty_like(x)
    out = torch.empty_like(x)
    if num_rows == 0:
        return summed, out
    block_c = triton.next_power_of_2(num_cols)
    _add_rms_norm_kernel[(num_rows,)](
        x, x if delta is None else delta, weight, summed, out,
        x.stride(0), x.stride(0) if delta is None else delta.stride(0), summed.stride(0), out.stride(0),
        eps,
        NUM_COLS=num_cols,
        BLOCK_C=block_c,
        HAS_DELTA=delta is not None,
        num_warps=min(16, max(1, block_c // 512)),
    )
    return summed, out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm of it): the Triton kernel on a GPU, the C++ one in an eager float32 CPU
    step (cpu_elementwise.py), the reference elsewhere."""
    if x.is_cuda and weight.dtype == x.dtype:
        return add_rms_norm_triton(x, delta, weight, eps)
    _check_inputs(x, delta, weight)
    if cpu_elementwise.serves(x, weight, *([] if delta is None else [delta])):
        return torch.ops.drivetrain.cpu_add_rms_norm(x, delta, weight, eps)
    return add_rms_norm_ref(x, delta, weight, eps)
