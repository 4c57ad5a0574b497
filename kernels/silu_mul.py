"""SwiGLU's gate: silu(gate) * up over the fused gate-up projection's output, in one pass: a
PyTorch reference, a Triton kernel and a dispatcher (PyTorch's is two kernels and a temporary)."""

import torch
import triton
import triton.language as tl

from kernels import cpu_elementwise
from kernels.checks import FLOAT_DTYPES, check_last_dim_contiguous, check_triton_device

BLOCK = 1024


def _check_inputs(gate_up: torch.Tensor) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 != 0:
        raise ValueError(f"gate_up must be (T, 2I); got {tuple(gate_up.shape)}")


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
    """Each op rounded to the input's dtype, as PyTorch does them one by one."""
    _check_inputs(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr, out_ptr,
    stride_in, stride_out,
    INTER: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = cols < INTER
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton version of silu_mul_ref."""
    _check_inputs(gate_up)
    check_triton_device(gate_up)
    check_last_dim_contiguous(gate_up=gate_up)
    if gate_up.dtype not in FLOAT_DTYPES:
        raise ValueError(f"gate_up must be one of {FLOAT_DTYPES}; got {gate_up.dtype}")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0), INTER=inter, BLOCK_I=BLOCK, num_warps=4,
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the Triton kernel on a GPU, the C++ one in an eager float32 CPU step
    (cpu_elementwise.py), the reference elsewhere."""
    if gate_up.is_cuda:
        return silu_mul_triton(gate_up)
    _check_inputs(gate_up)
    if cpu_elementwise.serves(gate_up):
        return torch.ops.drivetrain.cpu_silu_mul(gate_up)
    return silu_mul_ref(gate_up)
